"""A model's text that is not valid Unicode, through ``shopsimrl run`` and every reader of a run.

A lone surrogate (``"\\ud800"``) is valid JSON but cannot be UTF-8. Before, a tool call whose
arguments held one ended ``shopsimrl run`` with exit 1 (``TypeError: str is not valid UTF-8``
from orjson, no ``traces.jsonl``) on every rerun. Now the reply is a protocol error with a repair
turn, the trace keeps the reply exactly (the surrogate written as its ``\\uXXXX`` escape), and
the readers show it as that escape.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings
from shopsimrl.episode import AgentRuntime
from shopsimrl.prompts import PromptBuilder
from shopsimrl.records import dump_line, parse_trace_line, read_trace, to_plain
from shopsimrl.research import viewer
from shopsimrl.schemas import EpisodeJob, ModelOutput, ToolCall
from shopsimrl.skills import NoSkills
from shopsimrl.storage.reading import open_run
from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings, create_app
from tests.fakes import FakeModel
from tests.openai_stub import OpenAIStub, Reply, completion
from tests.testbed_process import ROOT, write_config

pytestmark = pytest.mark.slow

# The reply: the arguments text spells a lone surrogate as a JSON escape (pure ASCII).
ARGUMENTS_REPLY = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"shopsim-heuristic","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call-1","type":"function",'
    b'"function":{"name":"search","arguments":"{\\"query\\": \\"\\\\ud800\\"}"}}]},"finish_reason":"tool_calls"}],'
    b'"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}'
)
# A reply whose own field holds a lone surrogate: its content, escaped in the body.
FIELDS_REPLY = orjson.dumps(completion(content="x", tool_calls=[])).replace(b'"content":"x"', b'"content":"\\ud83d"')


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shopsimrl", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "traces.jsonl").read_bytes().splitlines()
    parsed = [parse_trace_line(line) for line in lines if line]
    assert all(record is not None for record in parsed)
    return [to_plain(record) for record in parsed if record is not None]


@pytest.fixture(scope="module")
def shop_url() -> Iterator[str]:
    with running_server(create_app(ShopSettings(slots=4))) as url:
        yield url


@pytest.fixture(scope="module")
def surrogate_run(shop_url: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Two val episodes whose model answers nothing but replies holding lone surrogates."""
    directory = tmp_path_factory.mktemp("surrogate")
    stub = OpenAIStub()
    stub.served_models = ["shopsim-heuristic"]
    json_reply = {"content-type": "application/json"}
    stub.queue(*[Reply(body=body, headers=json_reply) for body in (ARGUMENTS_REPLY, FIELDS_REPLY) * 4])
    with running_server(stub) as model_url:
        env = {**os.environ, "SHOPSIMRL_MODEL_BASE_URL": model_url + "/v1", "SHOPSIMRL_ENV_BASE_URL": shop_url}
        config = write_config(directory, name="surrogate", sample_size=2, max_steps=2)
        first = cli("run", str(config), "--no-progress", env=env)
        again = cli("run", str(config), "--no-progress", env=env)
    assert again.returncode == 0 and "0 to run" in again.stderr, again.stderr[-2000:]
    return directory / "runs/surrogate", first


def test_lone_surrogates_from_the_model_are_repair_turns_and_the_run_completes(
    surrogate_run: tuple[Path, subprocess.CompletedProcess[str]], shop_url: str
) -> None:
    run_dir, result = surrogate_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    traces = records(run_dir)
    assert len(traces) == 2 and all(read_trace(record).completed for record in traces)
    steps = [step for record in traces for step in record["steps"]]
    assert len(steps) == 4 and {step["protocol_error"]["code"] for step in steps} == {"invalid_unicode"}
    assert all(step["action"] is None for step in steps)  # nothing reached the shop
    raw = [step["model"]["raw_response"] for step in steps]
    # stored exactly: the arguments text with its escape, the content with its surrogate
    messages = [r["choices"][0]["message"] for r in raw]
    assert '{"query": "\\ud800"}' in [m["tool_calls"][0]["function"]["arguments"] for m in messages if m["tool_calls"]]
    assert "\ud83d" in [m["content"] for m in messages]
    for step in steps:
        feedback = json.loads(step["protocol_feedback"])
        assert feedback["code"] == "invalid_unicode" and "lone surrogate" in feedback["message"]
        assert "\ufffd" not in json.dumps(step["model"]["raw_response"])  # the raw reply is not scrubbed
    for record in traces:
        orjson.dumps(record["conversation"])  # everything sent to the model is valid UTF-8
        assert record["final"]["termination_reason"] == "action_limit"
    text = (run_dir / "traces.jsonl").read_bytes()
    text.decode("utf-8")  # a valid UTF-8 file, with the escape spelled out
    assert b'"content":"\\ud83d"' in text
    assert httpx.get(f"{shop_url}/healthz").json()["free_slots"] == 4


def _as_a_custom_model_would(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with lone surrogates in every model field a custom ChatModel fills, and in the
    error message: what the readers must take."""
    record = copy.deepcopy(record)
    for step in record["steps"]:
        model = step["model"]
        model["content"], model["reasoning"], model["finish_reason"] = "text \ud800", "thinking \udfff", "stop\ud800"
        model["response_id"] = "id-\udc80"
        model["tool_calls"] = [{"call_id": "c\ud800", "name": "search", "arguments": None, "raw_arguments": '{"q": "\ud800"}'}]
    record["error"] = {"stage": "model_step_1", "type": "E", "message": "boom \ud800"}
    return record


def test_every_reader_takes_a_run_holding_lone_surrogates(
    surrogate_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    source, _ = surrogate_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    traces = [_as_a_custom_model_would(record) for record in records(source)]
    (run_dir / "traces.jsonl").write_bytes(b"".join(dump_line(record) for record in traces))
    assert records(run_dir) == traces  # lossless
    # The episode whose raw replies hold the "\ud83d" content (which episode got which scripted
    # reply depends on the order the two episodes asked in).
    episode = next(
        record["episode_id"]
        for record in traces
        if any("\ud83d" in json.dumps(step["model"]["raw_response"], ensure_ascii=False) for step in record["steps"])
    )
    out = tmp_path / "out"
    out.mkdir()
    commands = [
        ("summarize", str(run_dir)),
        ("report", str(run_dir), "-o", str(out / "report.html")),
        ("show", str(run_dir), episode, "--thinking"),
        ("labels", str(run_dir), "-o", str(out / "labels.jsonl")),
        ("export", "sft", str(run_dir), "-o", str(out / "sft.jsonl"), "--include", "reasoning"),
        ("export", "judge-input", str(run_dir), "-o", str(out / "judge.jsonl"), "--include", "reasoning,persona,goal"),
        ("export", "table", str(run_dir), "--to", "parquet", "--level", "steps", "-o", str(out / "steps.parquet")),
        ("export", "table", str(run_dir), "--to", "csv", "--level", "steps", "-o", str(out / "steps.csv")),
        ("export", "table", str(run_dir), "--to", "csv", "--level", "episodes", "-o", str(out / "episodes.csv")),
        ("compare", str(run_dir), str(run_dir), "--json", str(out / "compare.json")),
    ]
    results = {command[:2]: cli(*command) for command in commands}
    for command, result in results.items():
        assert result.returncode == 0 and "Traceback" not in result.stderr, (command, result.stderr[-2000:])
    shown = results[("show", str(run_dir))].stdout
    assert "thinking \\udfff" in shown and "text \\ud800" in shown  # shown as the escape the file holds
    assert "stop\\ud800" in (out / "steps.csv").read_text(encoding="utf-8")
    judged = [json.loads(line) for line in (out / "judge.jsonl").read_text(encoding="utf-8").splitlines()]
    assert "thinking \udfff" in json.dumps(judged, ensure_ascii=False)  # the exact text, read back

    run = open_run(str(run_dir))
    with running_server(viewer.create_app(run, viewer.EpisodeIndex.build(run))) as url:
        page = httpx.get(f"{url}/episodes/{episode}", timeout=60)
        table = httpx.get(f"{url}/", timeout=60)
    assert page.status_code == 200 and table.status_code == 200
    assert "thinking \\udfff" in page.text and "\\ud83d" in page.text  # the model's fields and the raw reply


async def test_a_custom_chat_model_handing_over_lone_surrogates_gets_a_repair_turn(shop_url: str) -> None:
    """A ChatModel other than the HTTP adapter may return any str: the runtime checks the text that
    would reach the conversation or the shop, and sends U+FFFD in its place in the repair turn."""
    bad = ModelOutput(
        content=None,
        tool_calls=[
            ToolCall(
                call_id="call-\ud800", name="search", arguments={"query": "台灯\udfff"}, raw_arguments='{"query": "台灯\udfff"}'
            )
        ],
        finish_reason="tool_calls",
    )
    good = ModelOutput(
        tool_calls=[ToolCall(call_id="call-2", name="search", arguments={"query": "台灯"}, raw_arguments='{"query": "台灯"}')],
        finish_reason="tool_calls",
    )
    model = FakeModel([bad, good])
    environment = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=shop_url))
    runtime = AgentRuntime(model=model, environment=environment, prompts=PromptBuilder(), skills=NoSkills(), max_steps=2)
    try:
        typed = await runtime.run(EpisodeJob(task_id=19, sample_id=0, seed=3, split="val"))
    finally:
        await environment.aclose()
    trace = to_plain(typed)
    assert typed.completed, trace["error"]
    first, second = trace["steps"]
    assert first["protocol_error"]["code"] == "invalid_unicode" and first["action"] is None
    assert second["action"] == "search[台灯]"
    # the model saw its call back with U+FFFD; the step keeps what the model returned
    sent = model.calls[1]["messages"]
    assert sent[2]["tool_calls"][0]["id"] == "call-\ufffd" and sent[3]["tool_call_id"] == "call-\ufffd"
    orjson.dumps(sent)
    assert first["model"]["tool_calls"][0]["raw_arguments"] == '{"query": "台灯\udfff"}'
    again = parse_trace_line(dump_line(typed))
    assert again is not None and to_plain(again) == trace

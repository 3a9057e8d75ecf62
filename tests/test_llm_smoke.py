"""A real LLM end to end: SmolLM2-135M on llama.cpp's OpenAI-compatible server, the testbed shop.

The server runs from its own environment (``make llm-server``, which ``make test`` runs first:
the first time on a machine it compiles llama.cpp), started by that environment's interpreter
as a subprocess; nothing is installed into this interpreter's environment. Without that
environment the test is skipped, or fails under ``make test`` (SHOPSIMRL_LLM_REQUIRED), which
built it. The assertions are about structure, never about the model's skill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from shopsimrl.records import read_trace
from shopsimrl.schemas import TRACE_SCHEMA_VERSION, EpisodeJob
from shopsimrl.testbed.llm import MODEL_ALIAS, LlamaServer, tool_results_handler
from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings, create_app
from tests.testbed_process import llm_environment

ROOT = Path(__file__).resolve().parents[1]
# The small fixture catalog keeps every page short: a search page of the full synthetic catalog
# is about 5,000 SmolLM2 tokens (Chinese text), which makes each step slow on CPU and lets a few
# steps outgrow the model's 8k context. `make smoke-llm` runs the full catalog.
SMALL_CATALOG = ROOT / "tests" / "testbed" / "fixtures" / "catalog_small.json"
TASK_IDS = [0, 2]  # an electric kettle and a desk lamp in that catalog
TRACE_KEYS = {
    "schema_version", "episode_id", "job", "status", "provenance", "started_at", "ended_at", "duration_ms",
    "reset", "selected_skills", "conversation", "steps", "final", "error", "failure_class", "attempt",
}  # fmt: skip
STEP_KEYS = {"step_index", "observation", "tools", "model", "action", "environment"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    python, model = llm_environment()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with LlamaServer(model, python=python, n_ctx=8192, n_threads=2, log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def shop_url() -> Iterator[str]:
    with running_server(create_app(ShopSettings(slots=2), catalog_path=SMALL_CATALOG)) as url:
        yield url


def _config(tmp_path: Path) -> Path:
    split = {"version": "llm-smoke-fixture", "splits": {"val": {"task_ids": TASK_IDS, "persona": False, "role": "val"}}}
    (tmp_path / "split.json").write_text(json.dumps(split), encoding="utf-8")
    data = yaml.safe_load((ROOT / "configs" / "smoke_llm.yaml").read_text(encoding="utf-8"))
    data["experiment"]["output_dir"] = str(tmp_path / "runs")
    data["tasks"] = {"split_file": str(tmp_path / "split.json"), "split": "val"}
    data["runtime"]["max_steps"] = 3
    path = tmp_path / "smoke_llm.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    return path


def _tokens(usage: Any) -> tuple[int, int]:
    assert isinstance(usage, dict), usage
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    assert isinstance(prompt, int) and prompt > 0 and isinstance(completion, int) and completion >= 0, usage
    return prompt, completion


@pytest.mark.llm
@pytest.mark.slow
def test_two_episodes_against_llama_cpp(tmp_path: Path, llama: LlamaServer, shop_url: str) -> None:
    config = _config(tmp_path)
    env = {**os.environ, "SHOPSIMRL_MODEL_BASE_URL": llama.base_url, "SHOPSIMRL_ENV_BASE_URL": shop_url}
    result = subprocess.run(
        [sys.executable, "-m", "shopsimrl", "run", str(config), "--no-progress"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\nllama.cpp log tail:\n{llama.log_tail()}"

    run_dir = tmp_path / "runs" / "smoke-llm"
    records = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text(encoding="utf-8").splitlines()]
    assert sorted(r["job"]["task_id"] for r in records) == TASK_IDS

    model_steps = protocol_errors = policy_failures = actions = 0
    prompt_tokens = completion_tokens = 0
    for record in records:
        assert record["schema_version"] == TRACE_SCHEMA_VERSION and set(record) >= TRACE_KEYS, set(record) ^ TRACE_KEYS
        assert read_trace(record).completed and record["failure_class"] is None and record["error"] is None
        assert EpisodeJob.from_dict(record["job"]).episode_id == record["episode_id"]
        assert record["provenance"]["model"]["model"] == MODEL_ALIAS
        assert record["provenance"]["model"]["base_url"] == llama.base_url
        # The trace keeps the assistant tool-call turns as sent by the runtime (content null);
        # only the request body carries "" for llama.cpp.
        assert record["conversation"][0]["role"] == "system" and record["conversation"][1]["role"] == "user"
        assert 1 <= len(record["steps"]) <= 3
        for position, step in enumerate(record["steps"]):
            assert set(step) >= STEP_KEYS and step["step_index"] == position + 1
            output = step["model"]
            p, c = _tokens(output["usage"])
            prompt_tokens, completion_tokens = prompt_tokens + p, completion_tokens + c
            model_steps += 1
            if step.get("protocol_error"):
                # An unusable reply: repair feedback, nothing sent to the environment.
                protocol_errors += 1
                assert isinstance(step["protocol_error"]["code"], str) and step.get("protocol_feedback")
                assert step["action"] is None
            elif step.get("policy_failure"):
                # Only generation_length ends an episode from the policy side, and only last.
                policy_failures += 1
                assert step["policy_failure"]["code"] == "generation_length" and output["finish_reason"] == "length"
                assert position == len(record["steps"]) - 1
            else:
                # A parsed tool call that reached the environment.
                actions += 1
                assert len(output["tool_calls"]) == 1 and isinstance(output["tool_calls"][0]["arguments"], dict)
                assert output["tool_calls"][0]["name"] in {"search", "click"}
                assert isinstance(step["action"], str) and step["action"].startswith(("search[", "click["))
                assert isinstance(step["environment"], dict)
        assert record["final"]["termination_reason"]

    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    counts, behavior = summary["counts"], summary["behavior"]
    assert counts["requested"] == 2 and counts["completed"] == 2 and counts["failed"] == 0 and counts["missing"] == 0
    assert behavior["model_steps"] == model_steps
    assert behavior["protocol_errors"] == protocol_errors and behavior["policy_failures"] == policy_failures
    assert behavior["total_actions"] == actions
    tokens = summary["cost"]["tokens"]
    assert tokens["prompt_tokens"] == prompt_tokens and tokens["completion_tokens"] == completion_tokens


class _FakeLlama:
    """Records the completions the stock handler asks for; answers like llama.cpp would."""

    verbose = False

    def __init__(self, produce: int) -> None:
        self.produce = produce
        self.calls: list[dict[str, Any]] = []

    def create_completion(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(kwargs)
        limit = kwargs.get("max_tokens")
        cut = limit is not None and self.produce > limit
        return {"choices": [{"text": "x", "finish_reason": "length" if cut else "stop"}]}


def _stock_like_handler(*, llama: Any, messages: list[dict[str, Any]], max_tokens: int | None = None, **_: Any) -> dict[str, Any]:
    # Like chatml-function-calling: tool turns ignored, arguments generated with max_tokens=None.
    prompt = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages if m["role"] != "tool")
    llama.create_completion(prompt=prompt, max_tokens=None)
    return {"choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": None}}], "prompt": prompt}


def test_wrapped_handler_shows_tool_results_and_enforces_max_tokens() -> None:
    handler = tool_results_handler(_stock_like_handler)
    messages = [
        {"role": "user", "content": "task"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "PAGE-2"},
    ]
    long_output = _FakeLlama(produce=500)
    result = handler(llama=long_output, messages=messages, max_tokens=96)
    assert "<user>PAGE-2" in result["prompt"]  # the tool result reaches the prompt, as a user turn
    assert long_output.calls[0]["max_tokens"] == 96
    assert result["choices"][0]["finish_reason"] == "length"  # cut off: reported as OpenAI does
    assert messages[2]["role"] == "tool"  # the caller's list is not modified

    short_output = _FakeLlama(produce=10)
    assert handler(llama=short_output, messages=messages, max_tokens=96)["choices"][0]["finish_reason"] == "tool_calls"
    unlimited = _FakeLlama(produce=10)
    handler(llama=unlimited, messages=messages)
    assert unlimited.calls[0]["max_tokens"] is None  # no request limit: the handler's own default

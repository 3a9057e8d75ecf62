"""The skill builder's failure analyst with a real (tiny) model: SmolLM2-135M on llama.cpp's
OpenAI-compatible server, over a real testbed train run with failed episodes.

The model's decisions are toy-level; what is tested is the format: every failed episode gets a
record, each card either validates (its fields are the schema's) or the analysis is refused
with the contract error that names the problem, forced NO_PROPOSAL reasons are the firewall's
rules, the live sessions give their leases back, and every prompt fits the model's context.

The server runs from its own environment (``make llm-server``); without it the test is skipped,
or fails under ``SHOPSIMRL_LLM_REQUIRED`` (``make test``), like ``tests/test_llm_smoke.py``.

Sizes (docs/skills.md, "The real model"): the train run uses the small fixture catalog (a
search page of the full synthetic catalog alone is about 5,000 SmolLM2 tokens) and two steps
per episode (a search and a click, then the step limit: every episode fails), and the failure
analyst gets two calls (one live action, then the card, one try), so a compact failed trace,
the live page and the card's schema fit the model's 8,192-token context with room for the
answer, and the run takes minutes on a shared 2-core CPU rather than an hour.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from shopsimrl.environment import ShopSimulatorSettings
from shopsimrl.model import OpenAICompatibleSettings
from shopsimrl.research.skills.analyst import (
    ANALYSES_NAME,
    CARDS_NAME,
    ERRORS_NAME,
    AnalystConfig,
    latest_traces,
    run_success_analysis,
)
from shopsimrl.research.skills.cards import FAILURE_TOOL, SUCCESS_TOOL, FailureCard, validate_arguments
from shopsimrl.research.skills.failure import FailureAnalysis, FailureConfig
from shopsimrl.research.skills.firewall import FORCED_NO_PROPOSAL_RULES
from shopsimrl.testbed.llm import MODEL_ALIAS, LlamaServer
from tests.testbed_process import LocalTestbed, llm_environment, start_testbed

from .conftest import all_free, heuristic_train_run

REPO = Path(__file__).resolve().parents[2]
SMALL_CATALOG = REPO / "tests" / "testbed" / "fixtures" / "catalog_small.json"
TASK_IDS = [0, 1, 2, 3, 7]  # the small catalog's active tasks
N_CTX = 8192
MAX_TOKENS = 768
CONTRACT_ERROR = re.compile(
    r"^(\$[.\[]|\d+ tool calls|'[^']*' is not offered now|the arguments of \w+ are not|no call to \w+|[a-z][a-z_]+: )"
)
"""How every contract error of an attempt starts: a field path (the validator's), the stage's
own wording for a call it cannot use (no call, several, one not offered, bad JSON), or the model
client's code for a reply it could not parse or one cut off at ``max_tokens``."""


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    python, model = llm_environment()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with LlamaServer(model, python=python, n_ctx=N_CTX, n_threads=2, log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalTestbed, Path]]:
    """A train run of the small catalog's five tasks, two steps each: five failed episodes."""
    base = tmp_path_factory.mktemp("real-model-train")
    split = {"version": "skills-real-model", "splits": {"train": {"task_ids": TASK_IDS, "persona": False, "role": "train"}}}
    (base / "split.json").write_text(json.dumps(split), encoding="utf-8")
    with start_testbed(SHOPSIM_CATALOG=str(SMALL_CATALOG), SHOPSIM_POLICY_STRATEGY="naive") as bed:
        tasks = f"split_file: {base / 'split.json'}, split: train"
        yield bed, heuristic_train_run(base, bed, tasks, concurrency=4, max_steps=2, environment=", persona: false")


def smollm2(url: str, tool: str) -> OpenAICompatibleSettings:
    return OpenAICompatibleSettings(
        model=MODEL_ALIAS, base_url=url, api_key_env=None, checkpoint_id="HuggingFaceTB/SmolLM2-135M-Instruct@Q4_1.gguf",
        temperature=0.0, max_tokens=MAX_TOKENS, timeout=600, max_retries=2, retry_backoff_seconds=0.5,
        tool_choice={"type": "function", "function": {"name": tool}},  # forced: llama.cpp takes a named function
        assistant_content_empty_string=True,  # llama.cpp rejects assistant turns with content null
    )  # fmt: skip


def lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()] if path.exists() else []


def check_attempts(record: dict[str, Any]) -> None:
    """Every prompt fit the context with room for the answer; every error is a contract error."""
    for attempt in record["attempts"]:
        usage = attempt["usage"]
        assert usage.get("prompt_tokens", 0) + MAX_TOKENS <= N_CTX, (record["episode_id"], usage)
        if attempt["error"] is not None:
            assert CONTRACT_ERROR.match(attempt["error"]), attempt["error"]
            assert "context_length" not in attempt["error"], attempt["error"]


@pytest.mark.llm
@pytest.mark.slow
@pytest.mark.timeout(1800)  # ten model calls of a few thousand tokens each: minutes on a loaded 2-core CPU
def test_smollm2_failure_analyst_on_five_testbed_failures(
    tmp_path: Path, llama: LlamaServer, short_run: tuple[LocalTestbed, Path]
) -> None:
    bed, traces_path = short_run
    analysed = latest_traces(traces_path, expected=len(TASK_IDS))
    failed = [t for t in analysed if t.final is not None and t.final.reward_detail["r_success"] == 0]
    assert len(failed) == len(TASK_IDS) >= 5
    failure = FailureConfig(
        model=smollm2(llama.base_url, FAILURE_TOOL),
        environment=ShopSimulatorSettings(base_url=bed.shop_url, persona=False),
        max_failure_steps=2,
        attempts=1,
        live_tool_choice="auto",  # llama.cpp answers "required" with HTTP 500
    )
    # The success channel has nothing to do here; its settings only name the analyst.
    success = AnalystConfig(model=smollm2(llama.base_url, SUCCESS_TOOL), concurrency=1)
    started = time.monotonic()
    summary = run_success_analysis(analysed, tmp_path, success, FailureAnalysis(failure))
    seconds = time.monotonic() - started

    records = {r["episode_id"]: r for r in lines(tmp_path / ANALYSES_NAME)}
    errors = {r["episode_id"]: r for r in lines(tmp_path / ERRORS_NAME)}
    assert summary["episodes"]["total"] == len(analysed) and summary["episodes"]["failure"] == len(failed)
    figures: dict[str, Any] = {"valid": 0, "proposals": 0, "forced": {}, "no_proposal": 0, "refused": {}}
    for trace in failed:
        episode = trace.episode_id
        record = records.get(episode) or errors.get(episode)
        assert record is not None, f"no record of {episode}"
        assert record["channel"] == "failure" and record["status"] in ("ok", "invalid"), record.get("error")
        check_attempts(record)
        assert record["attempts"][-1]["offered"] == [FAILURE_TOOL] or record["status"] == "ok"
        assert record["live_session"]["task_id"] == trace.job.task_id and record["live_session"]["trials"]
        if record["status"] == "invalid":
            # Refused: the attempts ran out; the reason is the last contract error, named.
            assert record["error"]["type"] == "ContractError"
            last = record["attempts"][-1]["error"]
            assert last and last in record["error"]["message"], record["error"]
            reason = "field" if last.startswith("$") else last.split(":")[0].split(";")[0]
            figures["refused"][reason] = figures["refused"].get(reason, 0) + 1
            continue
        (entry,) = record["cards"]
        figures["valid"] += 1
        card, problem = validate_arguments(FailureCard, entry["card"])
        assert problem is None and card is not None, problem  # the stored card is the schema's
        assert set(entry["card"]) == set(FailureCard.model_fields)
        assert entry["card_id"] == f"failure-{episode}-01" and entry["evidence_refs"][0]["episode_id"] == episode
        assert entry["evidence_refs"][0]["step"] in {step.step_index for step in trace.steps}
        reasons = entry["forced_no_proposal_reasons"]
        assert set(reasons) <= set(FORCED_NO_PROPOSAL_RULES), reasons
        if entry["eligible"]:
            figures["proposals"] += 1
            assert reasons == [] and entry["card"]["status"] == entry["proposed_status"] != "NO_PROPOSAL"
            assert record["live_session"]["successful_trials"] >= 1 and record["live_session"]["valid_live_actions"] >= 1
        elif reasons:
            assert entry["proposed_status"] != "NO_PROPOSAL" and entry["card"]["status"] == "NO_PROPOSAL"
            assert entry["ineligible_reasons"] == reasons
            for reason in reasons:
                figures["forced"][reason] = figures["forced"].get(reason, 0) + 1
        else:
            assert entry["proposed_status"] == "NO_PROPOSAL" and entry["ineligible_reasons"] == ["no_proposal"]
            figures["no_proposal"] += 1
    assert all_free(bed)  # every live session's lease came back
    assert not (tmp_path / "leases").exists() or list((tmp_path / "leases").iterdir()) == []

    assert {c["episode_id"] for c in lines(tmp_path / CARDS_NAME)} == {e for e, r in records.items() if r["status"] == "ok"}
    figures["seconds"] = round(seconds)
    figures["calls"] = sum(len(r["attempts"]) for r in [*records.values(), *errors.values()])
    print(f"\nskills real model: {len(failed)} failed episodes: {json.dumps(figures, sort_keys=True)}")

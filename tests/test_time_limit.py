"""The per-episode time limit (issue 26, item 7): ``runtime.max_model_seconds`` of model time, then
the episode is terminated through the environment like the action limit, scored, and counted
apart. The clock is the replies' ``latency_ms`` (or an injected one): nothing here waits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shopsimrl import episode as episode_module
from shopsimrl.config import load_experiment_config
from shopsimrl.episode import AgentRuntime
from shopsimrl.metrics import SummaryAccumulator, format_summary_table
from shopsimrl.prompts import PromptBuilder
from shopsimrl.records import read_trace
from shopsimrl.research.episodes import episode_row
from shopsimrl.research.labels import episode_labels
from shopsimrl.runner.experiment import prepare
from shopsimrl.schemas import EpisodeJob, ModelOutput, fingerprint
from shopsimrl.skills import NoSkills
from tests.fakes import HOME_STATE, FakeEnvironment, FakeModel, call, env_result, written

JOB = EpisodeJob(task_id=7, sample_id=0, seed=50, split="val")
SEARCH_AGAIN = env_result(HOME_STATE)  # a page that never ends the episode


def reply(latency_ms: float | None, **extra: Any) -> ModelOutput:
    return ModelOutput(tool_calls=[call("search", {"query": "耳机"})], finish_reason="tool_calls", latency_ms=latency_ms, **extra)


def runtime(model: Any, env: Any, *, limit: float | None, max_steps: int = 30) -> AgentRuntime:
    return AgentRuntime(
        model=model, environment=env, prompts=PromptBuilder(), skills=NoSkills(), max_steps=max_steps, max_model_seconds=limit
    )


async def test_an_episode_past_its_model_time_is_terminated_scored_and_recorded() -> None:
    env = FakeEnvironment(steps=[SEARCH_AGAIN])
    model = FakeModel([reply(400.0)])
    record = await runtime(model, env, limit=1.0).run(JOB)
    trace = written(record)
    # 0.4 s, 0.8 s, 1.2 s: the third reply crossed the limit and was acted on; no fourth call.
    assert len(model.calls) == 3 and len(env.actions) == 3 and len(trace["steps"]) == 3
    assert env.terminations == ["action_limit"]  # ShopSimulator knows no time limit
    assert trace["status"] == "completed" and trace["failure_class"] is None and read_trace(trace).completed
    assert trace["final"]["termination_reason"] == "action_limit" and trace["final"]["reward"] == 0.0
    assert trace["time_limit"] == {"max_model_seconds": 1.0, "model_seconds": 1.2, "model_steps": 3, "sent_as": "action_limit"}
    assert trace["provenance"]["runtime"]["max_model_seconds"] == 1.0
    assert list(trace)[: len(read_trace(trace).ALWAYS_WRITTEN)] == list(read_trace(trace).ALWAYS_WRITTEN)  # v4 keys first

    row = episode_row(read_trace(trace))
    assert row["termination_reason"] == "time_limit" and row["completed"] is True and row["reward"] == 0.0
    labels = episode_labels(read_trace(trace))
    assert labels["labels"][-1] == "time_limit" and "action_limit" not in labels["details"]  # also repeated_action here
    assert labels["details"]["time_limit"]["evidence"] == [
        {"step": 3, "model_steps": 3, "model_seconds": 1.2, "max_model_seconds": 1.0}
    ]


async def test_the_summary_counts_time_limits_apart_from_action_limits() -> None:
    timed = await runtime(FakeModel([reply(600.0)]), FakeEnvironment(steps=[SEARCH_AGAIN]), limit=1.0).run(JOB)
    stepped = await runtime(FakeModel([reply(1.0)]), FakeEnvironment(steps=[SEARCH_AGAIN]), limit=1.0, max_steps=2).run(
        EpisodeJob(task_id=8, sample_id=0, seed=51, split="val")
    )
    bought = await runtime(FakeModel([reply(1.0)]), FakeEnvironment(), limit=1.0).run(
        EpisodeJob(task_id=9, sample_id=0, seed=52, split="val")
    )
    assert stepped.time_limit is None and bought.time_limit is None
    accumulator = SummaryAccumulator(requested=3)
    for record in (timed, stepped, bought):
        accumulator.add(read_trace(written(record)))
    summary = accumulator.result()
    assert summary["behavior"]["termination_reasons"] == {"action_limit": 1, "purchase": 1, "time_limit": 1}
    assert summary["counts"]["completed"] == 3 and summary["counts"]["scored"] == 3
    assert "time_limit 1" in format_summary_table(summary)


async def test_reaching_the_limit_exactly_ends_the_episode() -> None:
    env = FakeEnvironment(steps=[SEARCH_AGAIN])
    trace = written(await runtime(FakeModel([reply(500.0)]), env, limit=1.0).run(JOB))
    assert len(trace["steps"]) == 2 and trace["time_limit"]["model_seconds"] == 1.0


async def test_a_finished_episode_has_no_time_limit_key() -> None:
    env = FakeEnvironment()
    trace = written(await runtime(FakeModel([reply(900.0)]), env, limit=1.0).run(JOB))
    # 0.9 s then 1.8 s, but the second reply bought: done comes before any limit.
    assert trace["final"]["termination_reason"] == "purchase" and "time_limit" not in trace and env.terminations == []


async def test_the_action_limit_wins_when_both_run_out_together() -> None:
    env = FakeEnvironment(steps=[SEARCH_AGAIN])
    trace = written(await runtime(FakeModel([reply(500.0)]), env, limit=1.0, max_steps=2).run(JOB))
    assert env.terminations == ["action_limit"] and "time_limit" not in trace and len(trace["steps"]) == 2


async def test_retries_and_backoff_are_not_model_time() -> None:
    """A reply that took two failed attempts and 8 s of backoff still counts its answering attempt only."""
    attempts = [
        {"attempt": 1, "latency_ms": 30000.0, "status": None, "error": "timeout", "backoff_ms": 4000.0},
        {"attempt": 2, "latency_ms": 250.0, "status": 503, "error": "busy", "backoff_ms": 4000.0},
        {"attempt": 3, "latency_ms": 100.0, "status": 200, "error": None, "backoff_ms": 0.0},
    ]
    env = FakeEnvironment(steps=[SEARCH_AGAIN])
    trace = written(await runtime(FakeModel([reply(100.0, attempt_count=3, attempts=attempts)]), env, limit=1.0).run(JOB))
    assert len(trace["steps"]) == 10 and trace["time_limit"]["model_seconds"] == pytest.approx(1.0)


class _Clock:
    """An injected ``time`` for the runtime: it moves only when the model answers."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


async def test_a_model_without_latency_is_timed_by_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(episode_module, "time", clock)

    def answer(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ModelOutput:
        clock.now += 0.75  # the custom ChatModel reports no latency_ms
        return reply(None)

    env = FakeEnvironment(steps=[SEARCH_AGAIN])
    trace = written(await runtime(FakeModel(answer), env, limit=2.0).run(JOB))
    assert len(trace["steps"]) == 3 and trace["time_limit"]["model_seconds"] == 2.25 and env.terminations == ["action_limit"]


def test_the_limit_is_semantic_and_absent_from_plans_without_it(tmp_path: Path) -> None:
    text = (
        f"experiment: {{name: t, seed: 1}}\n"
        f"tasks: {{split_file: {Path(__file__).resolve().parents[1] / 'configs/splits/persona_splits.v1.json'}, split: val, sample_size: 2}}\n"
        "model: {name: m, base_url: 'http://127.0.0.1:1/v1', api_key_env: null}\n"
    )
    (tmp_path / "none.yaml").write_text(text, encoding="utf-8")
    (tmp_path / "limited.yaml").write_text(text + "runtime: {max_model_seconds: 120}\n", encoding="utf-8")
    plain = prepare(load_experiment_config(tmp_path / "none.yaml"))
    limited = prepare(load_experiment_config(tmp_path / "limited.yaml"))
    # Without a limit the runtime part is what it always was, so earlier runs resume (no exit 42).
    assert plain.plan()["runtime"] == {"max_steps": 30, "action_protocol": "openai-function-tools-repair-v3"}
    assert limited.plan()["runtime"]["max_model_seconds"] == 120.0
    assert fingerprint(plain.plan()) != fingerprint(limited.plan())
    built = limited.runtime(model=FakeModel([reply(1.0)]), environment=FakeEnvironment())
    assert built.max_model_seconds == 120.0 and built.runtime_identity() == limited.plan()["runtime"]
    assert json.loads(json.dumps(limited.plan()["runtime"])) == limited.plan()["runtime"]


def test_a_limit_that_is_no_positive_number_is_refused() -> None:
    with pytest.raises(ValueError, match="max_model_seconds"):
        runtime(FakeModel([reply(1.0)]), FakeEnvironment(), limit=0.0)

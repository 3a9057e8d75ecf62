"""Summary metrics: reference formulas, legacy traces, intervals, percentiles, bounded memory."""

from __future__ import annotations

import json
import math
import random
import re
import zlib
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.metrics import (
    SummaryAccumulator,
    _LogHistogram,
    format_summary_table,
    student_t_quantile,
    summarize_traces,
    unfinished_view,
    wilson_interval,
)
from shopsimrl.records import read_trace
from shopsimrl.schemas import SUMMARY_SCHEMA_VERSION, TRACE_SCHEMA_VERSION

FIXTURES = Path(__file__).parent / "fixtures"
IDENTITY: dict[str, Any] = {
    "schema_version": TRACE_SCHEMA_VERSION,
    "job": {"task_id": 5, "sample_id": 0, "seed": 7, "split": "val"},
}
"""What every trace record has: its schema version and its job (plus its episode_id)."""
CREATED = "2025-09-01T00:00:00+00:00"
REFERENCE_KEYS = {
    "counts": {"requested", "trace_files", "completed", "failed", "scored", "coverage"},
    "primary": {"reward_mean", "reward_sem", "success_rate"},
    "behavior": {
        "steps_mean",
        "model_steps",
        "protocol_errors",
        "protocol_error_rate",
        "policy_failures",
        "policy_failure_rate",
        "total_actions",
        "invalid_actions",
        "invalid_action_rate",
        "termination_reasons",
    },
    "cost": {"duration_ms_mean", "tokens"},
}


# --------------------------------------------------------------------------- v4 trace builders


def _usage(prompt: int, completion: int, reasoning: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def _model(usage: dict[str, Any] | None = None, latency: float = 500.0, **extra: Any) -> dict[str, Any]:
    model = {
        "content": None,
        "reasoning": "思考",
        "finish_reason": "tool_calls",
        "tool_calls": [
            {"call_id": "c1", "name": "click", "arguments": {"value": "buy now"}, "raw_arguments": '{"value": "buy now"}'}
        ],
        "usage": usage,
        "response_id": "r1",
        "metadata": {},
        "latency_ms": latency,
        "protocol_error": None,
        "policy_failure": None,
        "raw_response": None,
    }
    model.update(extra)
    return model


def _action_step(index: int, valid: bool = True, usage: dict[str, Any] | None = None, **model_extra: Any) -> dict[str, Any]:
    reason = "executed" if valid else "incomplete_options"
    feedback = {"action": "click[buy now]", "valid": valid, "reason": reason, "message": "…"}
    environment = {
        "done": False,
        "reward": 0.0,
        "observation": "页面",
        "message": "Continue interaction",
        "idx": "slot-0-1",
        "reward_detail": {},
        "purchase": {},
        "goal": {},
        "over": False,
        "observation_state": {},
        "action_feedback": feedback,
    }
    return {
        "step_index": index,
        "observation": "页面",
        "tools": [],
        "model": _model(usage, **model_extra),
        "action": "click[buy now]",
        "environment": environment,
    }


def _protocol_step(index: int) -> dict[str, Any]:
    error = {"code": "tool_call_count", "message": "expected exactly one tool call"}
    return {
        "step_index": index,
        "observation": "页面",
        "tools": [],
        "model": _model(None, protocol_error=error, tool_calls=[]),
        "action": None,
        "environment": None,
        "protocol_error": error,
        "protocol_feedback": {"type": "tool_protocol_error", "code": "tool_call_count"},
    }


def _policy_step(index: int) -> dict[str, Any]:
    failure = {"code": "generation_length", "message": "finish_reason=length"}
    return {
        "step_index": index,
        "observation": "页面",
        "tools": [],
        "model": _model(None, policy_failure=failure, tool_calls=[], finish_reason="length"),
        "action": None,
        "environment": None,
        "policy_failure": failure,
    }


def _trace(
    episode_id: str,
    *,
    reward: Any = 1.0,
    success: int = 1,
    steps: list[dict[str, Any]] | None = None,
    reason: str | None = "purchase",
    status: str = "completed",
    error: dict[str, Any] | None = None,
    duration_ms: float | None = 1000.0,
    task_id: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A v4 record; each episode id is its own task unless ``task_id`` says otherwise."""
    final = None
    if status == "completed":
        final = {
            "done": True,
            "over": True,
            "reward": reward,
            "termination_reason": reason,
            "reward_detail": {"r_strict": reward, "r_success": success, "reward_version": "shopsimulator-paper-reward-v2"},
        }
    record = {
        "schema_version": TRACE_SCHEMA_VERSION,
        "episode_id": episode_id,
        "status": status,
        "job": {
            "task_id": zlib.crc32(episode_id.encode()) if task_id is None else task_id,
            "sample_id": 0,
            "seed": 7,
            "split": "val",
        },
        "provenance": {},
        "started_at": "2025-08-30T10:00:00+00:00",
        "ended_at": "2025-08-30T10:01:00+00:00",
        "duration_ms": duration_ms,
        "reset": None,
        "selected_skills": [],
        "conversation": [],
        "steps": steps if steps is not None else [],
        "final": final,
        "error": error,
    }
    record.update(extra)
    return record


def _failed(episode_id: str, error_type: str | None = "ModelRequestError", **extra: Any) -> dict[str, Any]:
    error = {"stage": "model_step_1", "type": error_type, "message": "HTTP 503"} if error_type else None
    return _trace(episode_id, status="failed", error=error, **extra)


# --------------------------------------------------------------------------- reference behaviours


def test_e2_two_completed_traces() -> None:
    records = [
        _trace("task-000001__sample-000", reward=1.0, success=1, steps=[_action_step(1, True, _usage(5, 2, 3))]),
        _trace("task-000002__sample-000", reward=0.0, success=0, steps=[_action_step(1, False, _usage(5, 2, 3))]),
    ]
    summary = summarize_traces(records, created_at=CREATED)
    assert summary["counts"]["coverage"] == 1.0
    assert summary["primary"]["reward_mean"] == 0.5
    assert summary["primary"]["success_rate"] == 0.5
    behavior = summary["behavior"]
    assert (behavior["model_steps"], behavior["protocol_errors"], behavior["policy_failures"]) == (2, 0, 0)
    assert behavior["invalid_action_rate"] == 0.5
    assert summary["cost"]["tokens"]["total_tokens"] == 14
    assert summary["cost"]["tokens"]["reasoning_tokens"] == 6


def test_e5_only_failed_attempts() -> None:
    accumulator = SummaryAccumulator(requested=1)
    attempts = [_failed("task-000001__sample-000", attempt=n) for n in (1, 2, 3)]
    for earlier in attempts[:-1]:
        accumulator.note_superseded_attempt(read_trace(earlier))
    accumulator.add(read_trace(attempts[-1]))
    summary = accumulator.result(created_at=CREATED)
    assert summary["counts"]["failed"] == 1 and summary["counts"]["completed"] == 0
    assert summary["primary"]["reward_mean"] is None
    assert summary["primary"]["reward_ci95"] is None and summary["primary"]["score"] is None
    assert summary["retries"]["superseded_attempts"] == 2
    assert summary["retries"]["episodes_retried"] == 0  # only completed records count there
    assert summary["errors"] == {"ModelRequestError": 1}
    assert summary["behavior"]["steps_mean"] is None


def test_e6_protocol_step_and_action_step() -> None:
    summary = summarize_traces([_trace("e", steps=[_protocol_step(1), _action_step(2)])])
    behavior = summary["behavior"]
    assert behavior["model_steps"] == 2
    assert behavior["protocol_errors"] == 1
    assert behavior["protocol_error_rate"] == 0.5
    assert behavior["total_actions"] == 1


def test_e7_generation_length_is_completed_and_scored() -> None:
    trace = _trace("e", reward=0.0, success=0, steps=[_policy_step(1)], reason="generation_length")
    summary = summarize_traces([trace])
    assert summary["counts"]["completed"] == 1 and summary["counts"]["scored"] == 1
    assert summary["primary"]["reward_mean"] == 0.0
    behavior = summary["behavior"]
    assert behavior["policy_failures"] == 1 and behavior["policy_failure_rate"] == 1.0
    assert behavior["total_actions"] == 0 and behavior["invalid_action_rate"] is None
    assert behavior["termination_reasons"] == {"generation_length": 1}


# --------------------------------------------------------------------------- legacy traces


def _legacy_records() -> list[dict[str, Any]]:
    lines = (FIXTURES / "legacy_v4_traces.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_legacy_fixture_summary_matches_hand_computation() -> None:
    records = _legacy_records()
    assert len(records) == 6 and all("attempt" not in r and "failure_class" not in r for r in records)
    summary = summarize_traces(records, requested=8, created_at=CREATED)
    assert list(summary)[:2] == ["schema_version", "created_at"]
    assert summary["schema_version"] == SUMMARY_SCHEMA_VERSION and summary["created_at"] == CREATED
    for section, keys in REFERENCE_KEYS.items():
        assert keys <= set(summary[section]), section

    counts = summary["counts"]
    keys = ("requested", "trace_files", "completed", "failed", "scored")
    assert tuple(counts[key] for key in keys) == (8, 6, 4, 2, 4)
    assert counts["coverage"] == 0.5
    assert counts["missing"] is None  # ids unknown

    # Rewards 1.0 (purchase), 0.0 (action_limit), 0.0 (generation_length), 0.5 (purchase after a protocol error).
    primary = summary["primary"]
    assert primary["reward_mean"] == 0.375
    sem = math.sqrt(0.6875 / 3) / 2  # one episode per task: the clustered SE is the sample SD/√n
    assert primary["reward_sem"] == pytest.approx(sem, rel=1e-12)
    # Wilson with t(0.975, df=3) and n_eff = 0.375·0.625/sem² (the old t interval was [-0.39, 1.14]).
    assert primary["reward_ci95"] == pytest.approx(
        list(wilson_interval(0.375, 0.375 * 0.625 / sem**2, 3.182446305284263)), rel=1e-12
    )
    assert primary["score"] == 37.5
    assert primary["success_rate"] == 0.25 and primary["success_sem"] == pytest.approx(0.25)
    assert primary["success_ci95"] == pytest.approx(list(wilson_interval(0.25, 3.0, 3.182446305284263)), rel=1e-12)
    assert summary["intervals"] == {
        "confidence": 0.95,
        "method": "task-clustered-score-t",
        "cluster": "task_id",
        "clusters": 4,
        "notes": {},
    }
    # Intent to treat: the two failed episodes (no failure_class: written before it existed) count as 0.
    itt = summary["intent_to_treat"]
    assert (itt["episodes"], itt["failed_counted_as_zero"], itt["failed_unclassified"]) == (6, 2, 2)
    assert itt["reward_mean"] == primary["reward_mean_itt"] == 0.25 and itt["score"] == 25.0
    assert itt["success_rate"] == primary["success_rate_itt"] == pytest.approx(1 / 6)
    assert summary["per_task"] == {
        "tasks": 4,
        "episodes_per_task": {"min": 1, "max": 1},
        "pass_at_k": None,
        "pass_hat_k": None,
        "tasks_at_k": None,
        "pass_at_k_ci95": None,
        "pass_hat_k_ci95": None,
        "pass_k_notes": {},
    }

    assert summary["reward_components"] == {
        "r_att": 0.375,
        "r_loose": 0.4375,
        "r_option": 0.375,
        "r_price": 0.5,
        "r_strict": 0.375,
        "r_success": 0.25,
        "r_type": 0.5,
    }
    assert list(summary["reward_components"]) == sorted(summary["reward_components"])

    behavior = summary["behavior"]
    assert behavior["steps_mean"] == 3.0 and behavior["model_steps"] == 12
    assert behavior["protocol_errors"] == 1 and behavior["protocol_error_rate"] == 1 / 12
    assert behavior["policy_failures"] == 1 and behavior["policy_failure_rate"] == 1 / 12
    assert behavior["total_actions"] == 10 and behavior["invalid_actions"] == 1
    assert behavior["invalid_action_rate"] == 0.1
    assert behavior["termination_reasons"] == {"action_limit": 1, "generation_length": 1, "purchase": 2}

    assert summary["cost"]["duration_ms_mean"] == pytest.approx(13836.5)
    assert summary["cost"]["tokens"] == {
        "prompt_tokens": 12500,
        "completion_tokens": 5146,
        "total_tokens": 17646,
        "reasoning_tokens": 4600,
    }
    assert summary["errors"] == {"ModelRequestError": 1, "RuntimeError": 1}
    assert summary["failure_classes"] == {"unknown": 2}

    latencies = sorted([850.0, 920.0, 1010.0, 700.0, 760.0, 1300.0, 640.0, 30500.0, 480.0, 900.0, 1100.0, 1250.0])
    step_ms = summary["latency"]["model_step_ms"]
    assert step_ms["count"] == 12
    assert step_ms["mean"] == pytest.approx(sum(latencies) / 12)
    assert step_ms["p50"] == pytest.approx(latencies[5], rel=0.01)  # nearest rank ceil(0.5·12) = 6
    assert step_ms["p95"] == 30500.0  # rank 12 is the maximum, reported exactly
    assert summary["latency"]["episode_ms"]["p50"] == pytest.approx(12345.6, rel=0.01)
    assert summary["latency"]["episode_ms"]["p95"] == 20000.0

    assert summary["retries"] == {
        "model_calls_retried": 0,
        "model_retry_attempts": 0,
        "episodes_retried": 0,
        "superseded_attempts": 0,
    }
    # Earliest start 10:00:00 (a completed episode), latest end 11:00:00 (the failed one): one hour.
    assert summary["throughput"]["episodes_per_hour"] == pytest.approx(4.0)
    json.dumps(summary, allow_nan=False)


def test_legacy_fixture_without_requested_uses_record_count() -> None:
    summary = summarize_traces(_legacy_records())
    assert summary["counts"]["requested"] == 6
    assert summary["counts"]["coverage"] == pytest.approx(4 / 6)


def test_streaming_equals_batch_and_result_is_repeatable() -> None:
    records = _legacy_records()
    accumulator = SummaryAccumulator()
    for record in records:
        accumulator.add(read_trace(record))
    assert accumulator.result(created_at=CREATED) == summarize_traces(records, created_at=CREATED)
    assert accumulator.result(created_at=CREATED) == accumulator.result(created_at=CREATED)


def _reference_formulas(records: list[dict[str, Any]], requested: int) -> dict[str, Any]:
    """The v2 summary written out with lists, straight from the reference formulas."""
    from collections import Counter
    from statistics import fmean, stdev

    from shopsimrl.records import read_trace

    def numeric(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    done = [r for r in records if read_trace(r).completed]
    rewards = [float(r["final"]["reward"]) for r in done if numeric(r["final"].get("reward"))]
    details = [r["final"].get("reward_detail") or {} for r in done]
    successes = [float(d["r_success"]) for d in details if numeric(d.get("r_success"))]
    components: dict[str, list[float]] = {}
    for detail in details:
        for key, value in detail.items():
            if key.startswith("r_") and numeric(value):
                components.setdefault(key, []).append(float(value))
    steps = [s for r in done for s in r["steps"]]
    actions = [s["environment"] for s in steps if isinstance(s.get("environment"), dict)]
    invalid = [e for e in actions if isinstance(e.get("action_feedback"), dict) and e["action_feedback"].get("valid") is False]
    tokens: Counter[str] = Counter()
    for step in steps:
        usage = step["model"].get("usage") or {}
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            if isinstance(usage.get(key), int):
                tokens[key] += usage[key]
        reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
        if isinstance(reasoning, int):
            tokens["reasoning_tokens"] += reasoning
    protocol = sum(isinstance(s.get("protocol_error"), dict) for s in steps)
    return {
        "counts": {
            "requested": requested,
            "trace_files": len(records),
            "completed": len(done),
            "failed": len(records) - len(done),
            "scored": len(rewards),
            "coverage": len(done) / requested,
        },
        "reward_mean": fmean(rewards),
        "reward_sem": stdev(rewards) / math.sqrt(len(rewards)),
        "success_rate": fmean(successes),
        "components": {k: fmean(v) for k, v in sorted(components.items())},
        "steps_mean": fmean(len(r["steps"]) for r in done),
        "model_steps": len(steps),
        "protocol_error_rate": protocol / len(steps),
        "invalid_action_rate": len(invalid) / len(actions),
        "termination_reasons": dict(sorted(Counter(str(r["final"].get("termination_reason", "unknown")) for r in done).items())),
        "duration_ms_mean": fmean(r["duration_ms"] for r in done),
        "tokens": dict(tokens),
        "errors": dict(
            sorted(
                Counter(
                    str((r.get("error") or {}).get("type") or "unknown") for r in records if not read_trace(r).completed
                ).items()
            )
        ),
    }


def test_random_traces_match_the_reference_formulas() -> None:
    rng = random.Random(11)
    records = []
    for n in range(400):
        if rng.random() < 0.15:
            records.append(_failed(f"e{n}", error_type=rng.choice(["ModelRequestError", "HTTPError", None])))
            continue
        steps = []
        for index in range(1, rng.randint(1, 6)):
            kind = rng.random()
            if kind < 0.1:
                steps.append(_protocol_step(index))
            else:
                usage = _usage(rng.randint(100, 3000), rng.randint(1, 500), rng.choice([None, rng.randint(0, 100)]))
                steps.append(_action_step(index, rng.random() < 0.7, usage))
        reward = rng.choice([0.0, 1.0, rng.random(), rng.random() / 3])
        records.append(
            _trace(
                f"e{n}",
                reward=reward,
                success=int(reward == 1.0),
                steps=steps,
                reason=rng.choice(["purchase", "action_limit", None]),
                duration_ms=rng.uniform(1, 9e4),
            )
        )
    expected = _reference_formulas(records, requested=420)
    summary = summarize_traces(records, requested=420)
    assert {k: summary["counts"][k] for k in expected["counts"]} == expected["counts"]
    primary, behavior = summary["primary"], summary["behavior"]
    assert primary["reward_mean"] == expected["reward_mean"]  # compensated sum: bit-identical to fmean
    assert primary["reward_sem"] == pytest.approx(expected["reward_sem"], rel=1e-12)
    assert primary["success_rate"] == expected["success_rate"]
    assert summary["reward_components"] == expected["components"]
    assert behavior["steps_mean"] == expected["steps_mean"]
    assert behavior["model_steps"] == expected["model_steps"]
    assert behavior["protocol_error_rate"] == expected["protocol_error_rate"]
    assert behavior["invalid_action_rate"] == expected["invalid_action_rate"]
    assert behavior["termination_reasons"] == expected["termination_reasons"]
    assert summary["cost"]["duration_ms_mean"] == expected["duration_ms_mean"]
    assert summary["cost"]["tokens"] == expected["tokens"]
    assert summary["errors"] == expected["errors"]


# --------------------------------------------------------------------------- plan membership


def test_not_in_plan_records_are_counted_nowhere_else() -> None:
    plan = ["task-000001__sample-000", "task-000002__sample-000", "task-000003__sample-000"]
    records = [
        _trace(plan[0], reward=1.0),
        _failed(plan[1]),
        _trace("task-000099__sample-000", reward=0.0, steps=[_action_step(1)]),
        _failed("task-000098__sample-000", error_type="Boom"),
    ]
    summary = summarize_traces(records, requested_episode_ids=plan, created_at=CREATED)
    counts = summary["counts"]
    assert (counts["requested"], counts["trace_files"], counts["completed"], counts["failed"]) == (3, 2, 1, 1)
    assert counts["missing"] == 1 and counts["not_in_plan"] == 2
    assert counts["not_in_plan_ids_sample"] == ["task-000099__sample-000", "task-000098__sample-000"]
    assert counts["coverage"] == pytest.approx(1 / 3)
    assert summary["primary"]["reward_mean"] == 1.0
    assert summary["behavior"]["model_steps"] == 0
    assert summary["errors"] == {"ModelRequestError": 1}

    accumulator = SummaryAccumulator(requested_episode_ids=plan)
    for n in range(30):
        accumulator.add(read_trace(_trace(f"stray-{n:02d}")))
    accumulator.note_superseded_attempt(read_trace(_failed("stray-00")))
    result = accumulator.result()
    assert result["counts"]["not_in_plan"] == 30
    assert result["counts"]["not_in_plan_ids_sample"] == [f"stray-{n:02d}" for n in range(20)]
    assert result["retries"]["superseded_attempts"] == 0


def test_requested_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="requested=2 disagrees with 3"):
        SummaryAccumulator(requested_episode_ids=["a", "b", "c"], requested=2)
    with pytest.raises(ValueError, match="non-negative"):
        SummaryAccumulator(requested=-1)
    with pytest.raises(TypeError, match="not a string"):
        SummaryAccumulator(requested_episode_ids="abc")
    with pytest.raises(TypeError, match="must be an EpisodeTrace, got list"):
        SummaryAccumulator().add([1, 2])  # type: ignore[arg-type]
    assert summarize_traces([])["counts"]["coverage"] == 0.0


# --------------------------------------------------------------------------- robustness and retries


def test_odd_rewards_are_not_scored_and_missing_keys_never_raise() -> None:
    records = [
        _trace("nan", reward=float("nan")),
        _trace("inf", reward=float("inf")),
        _trace("bool", reward=True),
        _trace("text", reward="1.0"),
        _trace("ok", reward=0.25, success=0),
        {**IDENTITY, "episode_id": "bare", "status": "completed", "final": {"done": True}},  # bare minimum
        {
            **IDENTITY,
            "episode_id": "odd",
            "status": "completed",
            "final": {"done": True, "termination_reason": None},
            "steps": "not-a-list",
            "duration_ms": "slow",
        },
        {**IDENTITY, "episode_id": "f1", "status": "completed", "final": {"done": False}, "error": "not an object"},
        {**IDENTITY, "episode_id": "f2", "status": "odd", "final": "not an object"},
        {**IDENTITY, "episode_id": "f3", "status": "failed", "steps": [{"step_index": 1, "model": "x", "environment": 3}]},
    ]
    summary = summarize_traces(records, created_at=CREATED)
    assert summary["counts"]["completed"] == 7 and summary["counts"]["failed"] == 3
    assert summary["counts"]["scored"] == 1 and summary["primary"]["reward_mean"] == 0.25
    assert summary["primary"]["reward_sem"] is None and summary["primary"]["reward_ci95"] is None
    assert summary["errors"] == {"unknown": 3}
    assert summary["behavior"]["termination_reasons"] == {"None": 1, "purchase": 5, "unknown": 1}
    assert "nan" not in json.dumps(summary, allow_nan=False).lower()


@pytest.mark.parametrize(
    ("record", "error"),
    [
        ({"status": "completed", "final": {"done": True}}, "not a trace record"),  # no version, no id
        ({**IDENTITY, "schema_version": "shopsimrl-episode-v9", "episode_id": "v9"}, "'shopsimrl-episode-v9' is not one"),
        ({**IDENTITY, "episode_id": "nojob", "job": None}, "job"),
        ({**IDENTITY, "episode_id": "badjob", "job": {"task_id": True}}, "job"),
        ({**IDENTITY, "job": IDENTITY["job"]}, "episode_id"),
    ],
)
def test_what_is_not_a_trace_record_never_reaches_the_summary(record: dict[str, Any], error: str) -> None:
    """A record without a trace's identity (version, episode id, job) is refused by the reader, so
    the stores count its line as unreadable; it is never scored as an episode."""
    with pytest.raises(ValueError, match=re.escape(error)):
        summarize_traces([record])


def test_retry_statistics_from_additive_keys() -> None:
    steps = [
        _action_step(1, attempt_count=3, attempts=[{"status": 503}, {"status": 503}, {"status": 200}]),
        _action_step(2, attempt_count=1, attempts=[{"status": 200}]),
        _action_step(3, attempts=[{"error": "ReadTimeout"}, {"status": 200}]),  # list only
        _action_step(4, attempt_count=2),  # count only
    ]
    records = [
        _trace("a", steps=steps, attempt=2),
        _trace("b", attempt=1),
        _failed("c", attempt=3, failure_class="infrastructure"),
        _failed("d", failure_class="model"),
        _failed("e", failure_class="infrastructure"),
    ]
    summary = summarize_traces(records)
    assert summary["retries"]["model_calls_retried"] == 3
    assert summary["retries"]["model_retry_attempts"] == 2 + 1 + 1
    assert summary["retries"]["episodes_retried"] == 1
    assert summary["failure_classes"] == {"infrastructure": 2, "model": 1}


def test_throughput_span_and_unknown_span() -> None:
    first = _trace("a", started_at="2025-08-30T10:00:00Z", ended_at="2025-08-30T10:10:00Z")
    second = _trace("b", started_at="2025-08-30T10:05:00+00:00", ended_at="2025-08-30T10:30:00+00:00")
    accumulator = SummaryAccumulator()
    accumulator.add(read_trace(first))
    accumulator.add(read_trace(second))
    assert accumulator.result()["throughput"]["episodes_per_hour"] == pytest.approx(4.0)  # 2 in 30 min
    # An earlier attempt widens the span the run actually took.
    accumulator.note_superseded_attempt(read_trace(_failed("a", started_at="2025-08-30T09:30:00+00:00", ended_at=None)))
    assert accumulator.result()["throughput"]["episodes_per_hour"] == pytest.approx(2.0)
    unknown = summarize_traces([_trace("x", started_at=None, ended_at="garbage")])
    assert unknown["throughput"]["episodes_per_hour"] is None


# --------------------------------------------------------------------------- intervals


@pytest.mark.parametrize(
    ("df", "expected"),
    [
        (1, 12.706204736),
        (2, 4.302652730),
        (3, 3.182446305),
        (10, 2.228138852),
        (30, 2.042272456),
        (100, 1.983971519),
        (1000, 1.962339081),
        (10**9, 1.959963985),
    ],
)
def test_student_t_quantile_known_values(df: int, expected: float) -> None:
    assert student_t_quantile(0.975, df) == pytest.approx(expected, abs=1e-8)


def test_student_t_quantile_agrees_with_scipy() -> None:
    """The hand-written quantile (kept so the worker image needs no scipy) against scipy's, over
    the probabilities the summary and the tests use and degrees of freedom from 1 to beyond the
    Cornish-Fisher switch, fractional ones (effective sample sizes) included."""
    from scipy import stats

    for p in (0.5000001, 0.6, 0.9, 0.95, 0.975, 0.995, 0.9995):
        for df in (1, 1.5, 2, 3, 4.7, 7, 12, 29.3, 50, 120, 999, 1001, 5000, 1e6):
            expected = float(stats.t.ppf(p, df))
            assert student_t_quantile(p, df) == pytest.approx(expected, rel=1e-9, abs=1e-12), (p, df)


def test_student_t_quantile_symmetry_and_errors() -> None:
    assert student_t_quantile(0.025, 5) == pytest.approx(-student_t_quantile(0.975, 5))
    assert student_t_quantile(0.995, 1) == pytest.approx(63.656741163, abs=1e-7)
    assert student_t_quantile(0.5, 7) == 0.0
    with pytest.raises(ValueError, match="p must be in"):
        student_t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df must be"):
        student_t_quantile(0.975, 0)


def test_reward_ci_is_a_wilson_interval_with_t_quantile_and_effective_n() -> None:
    rewards = [0.2, 0.4, 0.9, 1.0]
    summary = summarize_traces([_trace(f"e{i}", reward=r) for i, r in enumerate(rewards)])
    mean = sum(rewards) / 4
    sem = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3) / 2
    assert summary["primary"]["reward_sem"] == pytest.approx(sem, rel=1e-12)
    lo, hi = summary["primary"]["reward_ci95"]
    assert (lo, hi) == pytest.approx(wilson_interval(mean, mean * (1 - mean) / sem**2, 3.182446305), rel=1e-9)
    assert 0.0 <= lo < mean < hi <= 1.0
    assert summary["primary"]["score"] == pytest.approx(mean * 100)


def test_wilson_interval_known_values() -> None:
    assert wilson_interval(0.5, 10) == pytest.approx((0.236593091, 0.763406909), abs=1e-9)
    assert wilson_interval(0.0, 10) == (0.0, pytest.approx(0.277532800, abs=1e-9))
    assert wilson_interval(1.0, 20) == (pytest.approx(0.838875, abs=1e-6), 1.0)
    assert wilson_interval(0.8, 100) == pytest.approx((0.7112, 0.8666), abs=5e-5)  # the textbook 80/100 example
    with pytest.raises(ValueError, match="n must be positive"):
        wilson_interval(0.5, 0)


# --------------------------------------------------------------------------- histogram and memory


def test_histogram_percentiles_within_one_percent() -> None:
    rng = random.Random(20250830)
    values = [rng.lognormvariate(6.5, 1.2) for _ in range(10_000)]
    values += [0.0] * 5 + [rng.uniform(0, 1e-3) for _ in range(5)]  # zeros and sub-range values
    histogram = _LogHistogram()
    for value in values:
        histogram.add(value)
    ordered = sorted(values)
    for q in (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999):
        exact = ordered[math.ceil(q * len(ordered)) - 1]
        assert histogram.quantile(q) == pytest.approx(exact, rel=0.01), q
    assert histogram.quantile(0.0001) == 0.0  # the zeros come first
    assert histogram.quantile(1.0) == max(values)
    assert histogram.stats.mean() == pytest.approx(math.fsum(values) / len(values), rel=1e-15)
    assert len(histogram.buckets) == _LogHistogram.SIZE < 3000


def _container_sizes(obj: Any, skip: set[str], path: str = "acc") -> dict[str, int]:
    """Sizes of every list/dict/set reachable from the accumulator's own attributes."""
    sizes: dict[str, int] = {}
    if isinstance(obj, (list, dict, set, frozenset, tuple)):
        sizes[path] = len(obj)
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            if isinstance(value, (list, dict, set, tuple)) or hasattr(value, "__slots__") or hasattr(value, "__dict__"):
                sizes.update(_container_sizes(value, skip, f"{path}[{key}]"))
        return sizes
    names = list(getattr(obj, "__dict__", {})) + [n for cls in type(obj).__mro__ for n in getattr(cls, "__slots__", ())]
    for name in names:
        if name in skip or not hasattr(obj, name):
            continue
        value = getattr(obj, name)
        if isinstance(value, (list, dict, set, frozenset, tuple)) or hasattr(value, "__slots__"):
            sizes.update(_container_sizes(value, skip, f"{path}.{name}"))
    return sizes


@pytest.mark.slow
def test_memory_is_flat_in_the_number_of_records() -> None:
    """500 tasks × 100 repeats: after every task was seen once, nothing grows any more."""
    rng = random.Random(7)
    tasks = 500

    def episode_id(n: int) -> str:
        return f"task-{n % tasks:06d}__sample-{n // tasks:03d}"

    plan = {episode_id(n) for n in range(50_000)}
    accumulator = SummaryAccumulator(requested_episode_ids=plan)

    def record(n: int) -> dict[str, Any]:
        if n % 10 == 0:
            error_type = rng.choice(["ModelRequestError", "EnvironmentError"])
            return _failed(episode_id(n), error_type=error_type, task_id=n % tasks)
        usage = _usage(900, rng.randint(1, 400), 10)
        step = _action_step(1, rng.random() < 0.2, usage, latency=rng.lognormvariate(6, 1))
        return _trace(
            episode_id(n),
            reward=rng.random(),
            success=rng.randint(0, 1),
            steps=[step],
            task_id=n % tasks,
            duration_ms=rng.uniform(1e3, 1e5),
            ended_at=f"2025-08-30T1{n % 10}:00:00+00:00",
        )

    for n in range(1_000):
        accumulator.add(read_trace(record(n)))
    early = _container_sizes(accumulator, skip={"_plan_ids"})
    for n in range(1_000, 50_000):
        accumulator.add(read_trace(record(n)))
    late = _container_sizes(accumulator, skip={"_plan_ids"})

    assert set(late) == set(early)
    for path, size in late.items():
        if path == "acc._tasks.rows":  # the per-task sums: one row per task, whatever the repeats
            assert size == early[path] == tasks
            continue
        # Only the fixed histograms are big; compensated-sum partials are bounded by the float range.
        assert size <= _LogHistogram.SIZE, path
        if ".buckets" not in path:
            assert size <= 64, path
            assert size <= early[path] + 4, path
    assert len(accumulator._tasks.values) == tasks * accumulator._tasks.WIDTH
    summary = accumulator.result()
    assert summary["counts"]["trace_files"] == 50_000 and summary["counts"]["failed"] == 5_000
    assert summary["latency"]["model_step_ms"]["count"] == 45_000
    assert 0.45 < summary["primary"]["reward_mean"] < 0.55


# --------------------------------------------------------------------------- table


def test_format_summary_table_shows_the_headline_numbers() -> None:
    summary = summarize_traces(_legacy_records(), requested=8, created_at=CREATED)
    table = format_summary_table(summary)
    assert table.splitlines()[0] == f"summary {SUMMARY_SCHEMA_VERSION} · created {CREATED}"
    assert "requested 8 · completed 4 · failed 2 · scored 4 · coverage 50.0%" in table
    assert "mean 0.3750" in table and "score 37.50" in table
    assert "rate 25.0%" in table
    assert "reward (ITT)         mean 0.2500 · 95% CI [0.0434, 0.7100] · score 25.00 · coverage 50.0%" in table
    assert "protocol errors 1 (8.3%)" in table
    assert "invalid 1 (10.0%)" in table
    assert "action_limit 1, generation_length 1, purchase 2" in table
    assert "ModelRequestError 1, RuntimeError 1" in table
    assert "4.0 episodes/h" in table


def test_the_printed_headline_counts_failures_and_names_the_conditional_mean() -> None:
    """A checkpoint that fails on its hard tasks: over completed episodes it looks perfect, over
    every planned episode it scores 0.6. The first number printed is the latter, with its interval
    and the coverage beside it; the conditional mean comes after and says what it is."""
    records = [_trace(f"easy-{i}", reward=1.0, success=1) for i in range(6)]
    records += [_failed(f"hard-{i}", failure_class="model_error") for i in range(3)]
    records.append(_failed("flaky", failure_class="infrastructure"))
    summary = summarize_traces(records, requested=10, created_at=CREATED)
    rows = format_summary_table(summary).splitlines()[3:]
    itt = summary["intent_to_treat"]
    low, high = itt["reward_ci95"]
    assert rows[0].split(maxsplit=2)[:2] == ["reward", "(ITT)"]
    assert rows[0].split(maxsplit=2)[2] == (
        f"mean 0.6667 · 95% CI [{low:.4f}, {high:.4f}] · score 66.67 · coverage 60.0% · over 9 episodes"
        " (failures as 0: 3, excluded: infrastructure 1, configuration 0 · re-rolled 0)"
    )
    assert rows[1].startswith("success (ITT)") and "rate 66.7%" in rows[1]
    assert rows[2].startswith("reward (completed)") and "mean 1.0000" in rows[2]
    assert rows[2].endswith("conditional: only the 6 scored episodes")
    assert rows[3].startswith("success (completed)")
    # No earlier row prints a reward: the conditional mean is never the first number read.
    assert not any(re.search(r"reward|\bscore\b", row) for row in format_summary_table(summary).splitlines()[:3])


def test_format_summary_table_accepts_a_reference_v2_summary() -> None:
    legacy_summary = {
        "schema_version": "shopsimrl-eval-summary-v2",
        "created_at": CREATED,
        "counts": {"requested": 2, "trace_files": 2, "completed": 2, "failed": 0, "scored": 2, "coverage": 1.0},
        "primary": {"reward_mean": 0.5, "reward_sem": 0.5, "success_rate": 0.5},
        "reward_components": {},
        "behavior": {"termination_reasons": {"purchase": 2}},
        "cost": {"tokens": {}},
        "errors": {},
    }
    table = format_summary_table(legacy_summary)
    assert "95% CI –" in table and "missing –" in table and "purchase 2" in table


def test_an_unfinished_view_counts_as_its_record() -> None:
    """The reducer holds unfinished attempts as views while it waits for a later attempt: a view
    must add and supersede exactly as the record does."""
    legacy = [json.loads(line) for line in (FIXTURES / "legacy_v4_traces.jsonl").read_text(encoding="utf-8").splitlines() if line]
    failed = [r for r in legacy if r.get("status") != "completed"]
    odd: list[dict[str, Any]] = [
        {
            **IDENTITY,
            "episode_id": "e1",
            "status": "failed",
            "error": {"type": "ReadTimeout"},
            "failure_class": "infrastructure",
            "started_at": "2026-01-01T00:00:00+00:00",
            "ended_at": "2026-01-01T00:01:00+00:00",
            "steps": [{"step_index": 1, "model": {"latency_ms": 5}}],
        },
        {**IDENTITY, "episode_id": "e2", "status": "failed", "error": "not an object", "failure_class": None},
        {**IDENTITY, "episode_id": "e3", "status": "failed", "failure_class": "policy", "ended_at": "bad time"},
        {**IDENTITY, "episode_id": "e4", "status": "completed", "final": {"done": False, "reward": 1.0}, "error": {"type": None}},
    ]
    records = failed + odd
    assert len(failed) >= 1
    for plan in (None, {r["episode_id"] for r in records[::2]}):
        whole, viewed = (SummaryAccumulator(requested_episode_ids=plan) for _ in range(2))
        for record in records:
            whole.add(read_trace(record))
            whole.note_superseded_attempt(read_trace(record))
            viewed.add(unfinished_view(read_trace(record)))
            viewed.note_superseded_attempt(unfinished_view(read_trace(record)))
        assert viewed.result(created_at=CREATED) == whole.result(created_at=CREATED)

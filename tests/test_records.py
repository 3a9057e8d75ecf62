"""Typed records: every file format read through its model, written back unchanged, described by
its checked-in JSON Schema, and refused with a clear error when it is of another version."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from jsonschema import Draft202012Validator

from shopsimrl.environment import EnvironmentResponseError
from shopsimrl.episode import AgentRuntime
from shopsimrl.manifest import build_manifest
from shopsimrl.metrics import SummaryAccumulator
from shopsimrl.prompts import PromptBuilder
from shopsimrl.records import (
    EpisodeTrace,
    ManifestIntegrityError,
    RecordFormatError,
    RecordVersionError,
    dump_document,
    dump_line,
    read_manifest,
    read_marker,
    read_summary,
    read_trace,
    to_plain,
)
from shopsimrl.records.jsonschema import SCHEMA_DIR, SCHEMA_MODELS, render, schema_document
from shopsimrl.schemas import EpisodeJob, ModelOutput
from shopsimrl.skills import NoSkills
from shopsimrl.storage.sharded import marker_document
from tests.fakes import FakeEnvironment, FakeModel, tool_output

LEGACY = Path(__file__).resolve().parent / "fixtures" / "legacy_v4_traces.jsonl"
JOB = EpisodeJob(task_id=7, sample_id=0, seed=50, split="val")


async def _written_traces() -> list[dict[str, Any]]:
    """Traces as the runtime writes them: completed, repaired, cut off by length, failed."""

    def runtime(model: Any, env: Any) -> AgentRuntime:
        return AgentRuntime(model=model, environment=env, prompts=PromptBuilder(), skills=NoSkills(), max_steps=5)

    happy = FakeModel(
        [tool_output("search", {"query": "蓝牙耳机"}, reasoning="先搜索"), tool_output("click", {"value": "buy now"})]
    )
    repaired = FakeModel(
        [
            ModelOutput(content="我想想", finish_reason="stop"),
            tool_output("search", {"q": "x"}),
            tool_output("click", {"value": "buy now"}),
        ]
    )
    cut = FakeModel(
        [ModelOutput(reasoning="想", finish_reason="length", policy_failure={"code": "generation_length", "message": "cut"})]
    )
    failing = FakeEnvironment([EnvironmentResponseError("boom", status=500)])
    traces = [
        await runtime(happy, FakeEnvironment()).run(JOB),
        await runtime(repaired, FakeEnvironment()).run(JOB),
        await runtime(cut, FakeEnvironment()).run(JOB),
        await runtime(FakeModel([tool_output("search", {"query": "x"})]), failing).run(JOB),
    ]
    return [orjson.loads(dump_line(trace)) for trace in traces]


def _legacy() -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in LEGACY.read_bytes().splitlines() if line.strip()]


async def test_every_trace_reads_through_its_model_and_writes_back_unchanged() -> None:
    written = await _written_traces()
    assert {trace["status"] for trace in written} == {"completed", "failed"}
    for raw in [*written, *_legacy()]:
        trace = read_trace(raw)
        assert isinstance(trace, EpisodeTrace) and trace.episode_id == raw["episode_id"]
        assert trace.completed == (raw["status"] == "completed" and raw["final"]["done"] is True)
        assert orjson.loads(dump_line(trace)) == raw  # same keys, same values: nothing added or lost


async def test_typed_fields_read_what_the_trace_says() -> None:
    happy, repaired, cut, failed = (read_trace(raw) for raw in await _written_traces())
    assert happy.final is not None and happy.final.reward == 1.0 and happy.steps[0].model.reasoning == "先搜索"
    assert happy.steps[0].action == "search[蓝牙耳机]" and happy.steps[0].environment is not None
    assert repaired.steps[0].effective_protocol_error is not None and repaired.steps[0].action is None
    assert repaired.steps[0].effective_protocol_error.code == "tool_call_count"
    assert cut.steps[0].effective_policy_failure is not None and cut.steps[0].effective_policy_failure.code == "generation_length"
    assert failed.status == "failed" and failed.failure_class == "environment_error" and failed.error is not None
    assert failed.error.stage == "environment_step_1"


async def test_written_records_match_their_checked_in_json_schema(tmp_path: Path) -> None:
    validators = {version: Draft202012Validator(schema_document(version)) for version in SCHEMA_MODELS}
    traces = await _written_traces()
    for trace in traces:
        validators["shopsimrl-episode-v4"].validate(trace)
    manifest = build_manifest({"experiment": "x", "jobs": [JOB.to_dict()]}, {"concurrency": 4})
    validators["shopsimrl-run-manifest-v2"].validate(to_plain(manifest))
    marker = marker_document(
        shard=0, plan_fingerprint="f" * 64, completed=1, failed=0, episode_ids_sha256="e" * 64,
        parts=[{"name": "part-00000-abcdef01.jsonl.zst", "sha256": "0" * 64, "records": 1}], writer="abcdef01",
    )  # fmt: skip
    validators["shopsimrl-shard-commit-v1"].validate(orjson.loads(dump_document(marker)))
    accumulator = SummaryAccumulator(requested_episode_ids=[JOB.episode_id])
    accumulator.add(read_trace(traces[0]))
    summary = json.loads(json.dumps(accumulator.result()))
    validators["shopsimrl-eval-summary-v3"].validate(summary)
    assert orjson.loads(dump_document(read_summary(summary))) == summary


def test_checked_in_schemas_are_the_models() -> None:
    files = sorted(path.name for path in SCHEMA_DIR.glob("*.schema.json"))
    assert files == sorted(f"{version}.schema.json" for version in SCHEMA_MODELS)
    for version in SCHEMA_MODELS:
        stored = (SCHEMA_DIR / f"{version}.schema.json").read_text(encoding="utf-8")
        assert stored == render(version), f"{version}: run `python -m shopsimrl.records` and commit the schema"
        Draft202012Validator.check_schema(json.loads(stored))


@pytest.mark.parametrize(
    ("reader", "record", "message"),
    [
        (read_trace, {"schema_version": "shopsimrl-episode-v5", "episode_id": "x"}, "'shopsimrl-episode-v5' is not one"),
        (read_trace, {"schema_version": "shopsimrl-run-manifest-v2"}, "not a trace record"),
        (read_trace, {"episode_id": "x"}, "not a trace record: schema_version None"),
        (read_manifest, {"schema_version": "shopsimrl-run-manifest-v3"}, "'shopsimrl-run-manifest-v3' is not one"),
        (read_marker, {"schema_version": "shopsimrl-shard-commit-v2"}, "'shopsimrl-shard-commit-v2' is not one"),
        (read_summary, {"schema_version": "shopsimrl-eval-summary-v4"}, "'shopsimrl-eval-summary-v4' is not one"),
    ],
)
def test_other_versions_are_refused_by_name(reader: Any, record: dict[str, Any], message: str) -> None:
    with pytest.raises(RecordVersionError, match=message.replace("(", r"\(")):
        reader(record)


def test_a_record_that_does_not_fit_names_the_field() -> None:
    raw = _legacy()[0]
    broken = copy.deepcopy(raw)
    del broken["job"]["seed"]
    with pytest.raises(RecordFormatError, match=r"traces.jsonl:3: job.seed: Field required"):
        read_trace(broken, "traces.jsonl:3")
    broken = copy.deepcopy(raw)
    broken["steps"][0]["step_index"] = "one"
    with pytest.raises(RecordFormatError, match=r"steps.0.step_index"):
        read_trace(broken)


def test_values_of_the_wrong_type_in_payloads_are_read_as_absent_never_coerced() -> None:
    raw = copy.deepcopy(_legacy()[0])
    raw["final"]["reward"] = "0.5"
    raw["final"]["reward_detail"]["r_success"] = True
    raw["steps"][0]["model"]["latency_ms"] = float("nan")
    raw["steps"][0]["model"]["usage"] = {"prompt_tokens": -3, "completion_tokens": "7", "total_tokens": 9}
    raw["failure_class"] = "a-class-of-the-future"
    trace = read_trace(raw)
    assert trace.final is not None and trace.final.reward is None and trace.final.component("r_success") is None
    assert trace.steps[0].model.latency_ms is None and trace.failure_class == "a-class-of-the-future"
    usage = trace.steps[0].model.usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (None, None, 9)


def test_a_manifest_whose_plan_was_edited_is_refused() -> None:
    manifest = to_plain(build_manifest({"experiment": "x", "jobs": [JOB.to_dict()]}))
    assert read_manifest(manifest).plan.jobs()[0].task_id == 7
    manifest["plan"]["experiment"] = "y"
    with pytest.raises(ManifestIntegrityError, match=r"manifest\.json: plan_fingerprint does not match"):
        read_manifest(manifest)

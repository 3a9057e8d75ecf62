"""The run manifest, ``shopsimrl-run-manifest-v1`` and ``-v2`` (docs/runtime_eval.md §3).

The plan is the fingerprinted part: it is checked against ``plan_fingerprint`` as it was read,
byte for byte through canonical JSON, before any field is typed, so a lenient reading of one of
its values can never hide an edit. Its identity keys are typed; the rest of it (the model's
sampling, the prompt and skill identities) stays as stored.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import Field, field_validator

from shopsimrl.records._base import Count, FlexStr, Record
from shopsimrl.records.trace import JobRecord

__all__ = [
    "MANIFEST_SCHEMA_VERSION",
    "MANIFEST_SCHEMA_VERSIONS",
    "PlanModel",
    "PlanSplit",
    "RunManifest",
    "RunPlan",
]

MANIFEST_SCHEMA_VERSION: Final = "shopsimrl-run-manifest-v2"
"""v2 adds ``fingerprint_version`` and a separate, non-fingerprinted ``execution`` block."""
MANIFEST_SCHEMA_VERSIONS = ("shopsimrl-run-manifest-v1", MANIFEST_SCHEMA_VERSION)


class PlanModel(Record):
    """The model's semantic identity in the plan."""

    provider: FlexStr = None
    model: FlexStr = None
    checkpoint_id: FlexStr = None
    sampling: dict[str, Any] = Field(default_factory=dict)


class PlanSplit(Record):
    """The split's identity: never a path."""

    name: FlexStr = None
    split_version: FlexStr = None
    role: FlexStr = None
    persona: bool | None = None
    task_count: Count = None
    task_ids_sha256: FlexStr = None
    file_name: FlexStr = None


class RunPlan(Record):
    """Everything that changes outputs; ``fingerprint(plan)`` is the run's identity."""

    pipeline_version: FlexStr = None
    fingerprint_version: FlexStr = None
    experiment: FlexStr = None
    model_id: FlexStr = None
    model: PlanModel = Field(default_factory=PlanModel)
    task_split: PlanSplit = Field(default_factory=PlanSplit)
    jobs: list[JobRecord]

    @field_validator("model", "task_split", mode="before")
    @classmethod
    def _object_or_empty(cls, value: Any) -> Any:
        return value if isinstance(value, dict | Record) else {}


class RunManifest(Record):
    """``manifest.json``: the frozen plan, its fingerprint and the execution settings of the
    invocation that created it."""

    schema_version: Literal["shopsimrl-run-manifest-v1", "shopsimrl-run-manifest-v2"] = MANIFEST_SCHEMA_VERSION
    created_at: FlexStr = None
    fingerprint_version: FlexStr = None
    """Absent in v1."""
    plan_fingerprint: str
    """sha256 of the plan's canonical JSON."""
    plan: RunPlan
    execution: dict[str, Any] = Field(default_factory=dict)
    """Concurrency, URLs (credentials removed), timeouts, retries: free to change on resume (v2)."""

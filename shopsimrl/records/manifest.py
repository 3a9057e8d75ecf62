"""The run manifest, ``shopsimrl-run-manifest-v1`` and ``-v2`` (docs/runtime_eval.md §3).

The plan is the fingerprinted part: :func:`~shopsimrl.records.read_manifest` checks it against
``plan_fingerprint`` as it was read, before anything is typed, and the plan keeps every key and
value exactly as stored (a :class:`~shopsimrl.records._base.Payload`), so ``fingerprint(plan)``
of a plan read back is always the stored one. Its identity keys are read through properties.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal

from pydantic import Field, ValidationError

from shopsimrl.records._base import FlexStr, Object, Payload, Record
from shopsimrl.records.trace import JobRecord

__all__ = ["MANIFEST_SCHEMA_VERSION", "MANIFEST_SCHEMA_VERSIONS", "RunManifest", "RunPlan"]

MANIFEST_SCHEMA_VERSION: Final = "shopsimrl-run-manifest-v2"
"""v2 adds ``fingerprint_version`` and a separate, non-fingerprinted ``execution`` block."""
MANIFEST_SCHEMA_VERSIONS = ("shopsimrl-run-manifest-v1", MANIFEST_SCHEMA_VERSION)


class RunPlan(Payload):
    """Everything that changes outputs; ``fingerprint(plan)`` is the run's identity."""

    DOCUMENTED: ClassVar[dict[str, dict[str, Any]]] = {
        "pipeline_version": {"type": "string"},
        "fingerprint_version": {"type": "string"},
        "experiment": {"type": "string"},
        "model_id": {"type": "string"},
        "model": {"type": "object", "description": "provider, model, checkpoint_id (when set), sampling"},
        "task_split": {"type": "object", "description": "name, split_version, role, persona, task_count, task_ids_sha256, file_name"},
        "sampling": {"type": "object", "description": "seed, sample_size, repeats"},
        "jobs": {"type": "array", "items": {"type": "object"}, "description": "the frozen job list"},
        "environment": {"type": "object"},
        "runtime": {"type": "object"},
        "prompt": {"type": "object"},
        "skills": {"type": "object"},
        "test_guard": {"type": "object"},
    }  # fmt: skip

    @property
    def experiment(self) -> str | None:
        return self._text("experiment")

    @property
    def model_id(self) -> str | None:
        return self._text("model_id")

    @property
    def pipeline_version(self) -> str | None:
        return self._text("pipeline_version")

    @property
    def model(self) -> dict[str, Any]:
        return self._object("model") or {}

    @property
    def task_split(self) -> dict[str, Any]:
        return self._object("task_split") or {}

    def jobs(self) -> list[JobRecord]:
        """The frozen job list, each job read strictly (ValueError naming the first bad one)."""
        jobs = self.get("jobs")
        if not isinstance(jobs, list):
            raise ValueError("plan.jobs must be a list")
        try:
            return [JobRecord.model_validate(job) for job in jobs]
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ValueError(f"plan.jobs: {'.'.join(map(str, first['loc'])) or 'job'}: {first['msg']}") from None


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
    execution: Object = Field(default_factory=dict)
    """Concurrency, URLs (credentials removed), timeouts, retries: free to change on resume (v2)."""

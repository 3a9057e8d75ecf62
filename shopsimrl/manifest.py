"""The run manifest: the frozen semantic plan, its fingerprint, and the field-level diff on mismatch.

``plan_fingerprint = fingerprint(plan)``. The plan holds only what changes outputs: pipeline and
fingerprint versions, experiment name, model semantic identity (model, checkpoint_id, sampling,
extra_body), split identity (name, version, role, ids digest — never a path), the job list,
environment mode, runtime limits, prompt identity and skill-bank identity. Execution settings
(concurrency, timeouts, retries, URLs, output location, shard count) live in ``execution`` and
may change between invocations without blocking resume.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from shopsimrl import __version__
from shopsimrl.records import (
    MANIFEST_SCHEMA_VERSION,
    MANIFEST_SCHEMA_VERSIONS,
    SUMMARY_SCHEMA_VERSION,
    TRACE_SCHEMA_VERSION,
    RecordFormatError,
    RecordVersionError,
    RunManifest,
    RunPlan,
    read_manifest,
)
from shopsimrl.schemas import FINGERPRINT_VERSION, TraceFormatError, fingerprint, redact_uri

__all__ = [
    "FingerprintMismatchError",
    "ManifestError",
    "build_manifest",
    "flatten",
    "manifest_head",
    "plan_diff",
    "run_identity",
    "validate_manifest",
]


class ManifestError(TraceFormatError):
    """manifest.json is unreadable, of an unknown version, or inconsistent with itself."""


class FingerprintMismatchError(RuntimeError):
    """The run location already holds a run with another semantic plan."""

    def __init__(self, location: str, existing: str, new: str, differences: list[str]) -> None:
        self.location = location
        self.differences = differences
        shown = "\n".join(f"  {line}" for line in differences[:40])
        more = f"\n  … and {len(differences) - 40} more" if len(differences) > 40 else ""
        super().__init__(
            f"{location} holds a run with plan fingerprint {existing[:12]}…, this config plans {new[:12]}…; "
            f"differing keys:\n{shown}{more}\nUse another experiment name or output location to start a new run."
        )


def build_manifest(
    plan: dict[str, Any], execution: dict[str, Any] | None = None, *, plan_fingerprint: str | None = None
) -> RunManifest:
    """The manifest; ``plan_fingerprint``: ``fingerprint(plan)`` when the caller has it already (a
    100,000-job plan takes a few hundred ms to hash)."""
    return RunManifest(
        schema_version=MANIFEST_SCHEMA_VERSION,
        created_at=datetime.now(UTC).isoformat(),
        fingerprint_version=FINGERPRINT_VERSION,
        plan_fingerprint=plan_fingerprint or fingerprint(plan),
        plan=RunPlan.model_validate(plan),
        execution=execution or {},
    )


def validate_manifest(manifest: Any, where: str) -> RunManifest:
    """A parsed manifest.json as a :class:`RunManifest`; :class:`ManifestError` naming ``where``
    and what is wrong otherwise (another version, a plan that does not match its fingerprint)."""
    if not isinstance(manifest, dict):
        raise ManifestError(f"{where}: the manifest must be a JSON object")
    version = manifest.get("schema_version")
    if version not in MANIFEST_SCHEMA_VERSIONS:
        raise ManifestError(
            f"{where}: unsupported manifest schema_version {version!r}; this shopsimrl reads {', '.join(MANIFEST_SCHEMA_VERSIONS)}"
        )
    try:
        return read_manifest(manifest, where)
    except (RecordFormatError, RecordVersionError) as exc:
        raise ManifestError(str(exc)) from None


def flatten(value: Any) -> dict[str, Any]:
    """Nested settings as dotted keys (``sampling.temperature``), in the order they come; an empty
    mapping is a value of its own."""
    out: dict[str, Any] = {}
    _flatten(value, "", out)
    return out


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value


def plan_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences between two plans; job lists are compared by count and digest."""
    old_jobs, new_jobs = old.get("jobs"), new.get("jobs")
    flat_old = flatten({k: v for k, v in old.items() if k != "jobs"})
    flat_new = flatten({k: v for k, v in new.items() if k != "jobs"})
    lines = [
        f"{key}: {flat_old.get(key, '<absent>')!r} -> {flat_new.get(key, '<absent>')!r}"
        for key in sorted(set(flat_old) | set(flat_new))
        if flat_old.get(key, "<absent>") != flat_new.get(key, "<absent>")
    ]
    if old_jobs != new_jobs:
        old_count = len(old_jobs) if isinstance(old_jobs, list) else 0
        new_count = len(new_jobs) if isinstance(new_jobs, list) else 0
        lines.append(
            f"jobs: {old_count} jobs (digest {fingerprint(old_jobs)[:12]}) -> {new_count} jobs (digest {fingerprint(new_jobs)[:12]})"
        )
    return lines


# --------------------------------------------------------------------------- identity in summaries


def run_identity(manifest: RunManifest | Mapping[str, Any] | None, *, uri: str | None) -> dict[str, Any]:
    """The ``run`` block of ``summary.json``: which run these numbers belong to.

    ``manifest`` may be the full manifest or its head (:func:`manifest_head`); without one
    (traces of the earlier implementation) every plan-derived field is null. ``uri`` is
    redacted: no credentials reach the summary.
    """
    if isinstance(manifest, RunManifest):
        manifest = {
            "schema_version": manifest.schema_version,
            "fingerprint_version": manifest.fingerprint_version,
            "plan_fingerprint": manifest.plan_fingerprint,
            "plan": manifest.plan.as_dict(),
        }
    manifest = manifest or {}
    plan = _object(manifest.get("plan"))
    model = _object(plan.get("model"))
    split = _object(plan.get("task_split"))
    return {
        "uri": redact_uri(uri) if uri else None,
        "experiment": plan.get("experiment"),
        "model_id": plan.get("model_id"),
        "model_name": model.get("model"),
        "checkpoint_id": model.get("checkpoint_id"),
        "plan_fingerprint": manifest.get("plan_fingerprint"),
        "split": {
            "name": split.get("name"),
            "task_count": split.get("task_count"),
            "task_ids_sha256": split.get("task_ids_sha256"),
        },
        "versions": {
            "shopsimrl": __version__,
            "pipeline": plan.get("pipeline_version"),
            "fingerprint": manifest.get("fingerprint_version"),
            "manifest_schema": manifest.get("schema_version"),
            "trace_schema": TRACE_SCHEMA_VERSION,
            "summary_schema": SUMMARY_SCHEMA_VERSION,
        },
    }


def _object(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


_DECODER = json.JSONDecoder()


def manifest_head(data: bytes) -> dict[str, Any] | None:
    """The manifest's keys up to the job list, parsed from the first bytes of manifest.json.

    The writer puts ``schema_version`` … ``plan_fingerprint`` and the plan's identity keys
    before ``plan.jobs``, so a bounded prefix carries everything :func:`run_identity` needs
    without reading a job list that grows with the run. None when the prefix ends before the job
    list or is not a manifest (read the whole file then).
    """
    text = data.decode("utf-8", errors="ignore")
    try:
        top, position, found = _members(text, 0, stop="plan")
        if not found:
            return None
        plan, _, found = _members(text, position, stop="jobs")
    except (ValueError, IndexError):
        return None
    return {**top, "plan": plan} if found else None


def _members(text: str, position: int, *, stop: str) -> tuple[dict[str, Any], int, bool]:
    """Decode an object's members from ``text[position]`` (its ``{``) until the key ``stop``.

    Returns the members before it, the position of its value, and whether it was reached."""
    members: dict[str, Any] = {}
    position = _skip(text, position)
    if text[position] != "{":
        raise ValueError("not an object")
    position += 1
    while True:
        position = _skip(text, position)
        if text[position] == "}":
            return members, position + 1, False
        key, position = _DECODER.raw_decode(text, position)
        position = _skip(text, position)
        if not isinstance(key, str) or text[position] != ":":
            raise ValueError("not an object member")
        position = _skip(text, position + 1)
        if key == stop:
            return members, position, True
        members[key], position = _DECODER.raw_decode(text, position)
        position = _skip(text, position)
        if text[position] == ",":
            position += 1


def _skip(text: str, position: int) -> int:
    while text[position] in " \t\r\n":
        position += 1
    return position

"""Persisted shapes and identity helpers: URL redaction, JSON safety, the public surface."""

from __future__ import annotations

import math

import shopsimrl.schemas as schemas
from shopsimrl.schemas import EpisodeJob, TraceFormatError, json_safe, redact_uri


def test_urls_are_redacted_before_they_persist() -> None:
    assert redact_uri("s3://AKIA:secret@bucket/x") == "s3://bucket/x"
    assert redact_uri("https://gw.example/v1?api-key=sk-1&region=eu") == "https://gw.example/v1?api-key=REDACTED&region=eu"
    assert redact_uri("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
    assert redact_uri("./runs/x") == "./runs/x"


def test_json_safe_replaces_what_canonical_json_refuses() -> None:
    assert json_safe({"a": math.nan, "b": [math.inf, 1.5], 3: object}) == {"a": None, "b": [None, 1.5], "3": repr(object)}


def test_job_records_are_validated() -> None:
    assert EpisodeJob.from_dict({"task_id": 1, "sample_id": 0, "seed": 5, "split": "val"}).episode_id == "task-000001__sample-000"
    for bad in (
        {"task_id": -1, "sample_id": 0, "seed": 5, "split": "val"},
        {"task_id": 1},
        {"task_id": True, "sample_id": 0, "seed": 1, "split": "v"},
    ):
        try:
            EpisodeJob.from_dict(bad)
        except TraceFormatError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_public_surface_is_pinned() -> None:
    assert sorted(schemas.__all__) == sorted(
        name
        for name in vars(schemas)
        if not name.startswith("_")
        and name.isidentifier()
        and getattr(getattr(schemas, name), "__module__", "shopsimrl.schemas") == "shopsimrl.schemas"
        and name not in {"annotations", "Any", "Literal", "TraceStatus"}
        and not isinstance(getattr(schemas, name), type(schemas))
    )


def test_redaction_keeps_everything_else_verbatim() -> None:
    assert redact_uri("http://u:p@[::1]:8080/v1") == "http://[::1]:8080/v1"
    assert (
        redact_uri("https://Host.Example:443/v1?flag&design=x&access_token=abc;v")
        == "https://Host.Example:443/v1?flag&design=x&access_token=REDACTED"
    )
    assert redact_uri("https://h/v1?sig=1&author=me&monkey=2") == "https://h/v1?sig=REDACTED&author=me&monkey=2"


# Fingerprints identify existing runs: a change to canonical JSON (key order, separators, float
# or escape formatting) would make every frozen run refuse its own config (exit 42).
REFERENCE_PLAN = {
    "pipeline_version": "shopsimrl-v0.5",
    "fingerprint_version": "semantic-plan-v2",
    "experiment": "réf “plan”",
    "model_id": "qwen",
    "model": {
        "model": "Qwen/Qwen3.5-4B",
        "checkpoint_id": None,
        "sampling": {
            "temperature": 0.7,
            "top_p": 1e-05,
            "max_tokens": 512,
            "extra_body": {"min_p": 0.05, "big": 12345678901234567890},
        },
    },
    "task_split": {"name": "val", "task_count": 3, "task_ids_sha256": "ab" * 32},
    "runtime": {"max_steps": 30, "ratio": 1e16, "negative": -0.0, "tab\tkey": "line\nbreak\u2028\x7f😀"},
    "jobs": [{"task_id": t, "sample_id": s, "seed": t * 7 + s, "split": "val"} for t in (1, 2, 3) for s in (0, 1)],
}


def test_the_fingerprint_of_a_reference_plan_is_unchanged() -> None:
    assert schemas.fingerprint(REFERENCE_PLAN) == "8f3a353ae0ddd29ec13c5afe6a8566f80ed0d1245a993c9cf55163c187f7ab9b"

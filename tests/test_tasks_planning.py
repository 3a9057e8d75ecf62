"""Split files, the test guard's inputs, and bit-compatible planning (reference §2, E1, golden vectors)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shopsimrl.planning import EvaluationPlan, PlanError, build_jobs, episode_seed, shard_jobs
from shopsimrl.schemas import EpisodeJob, canonical_json, episode_id_for, fingerprint
from shopsimrl.tasks import SplitError, load_task_split, task_ids_sha256

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ROOT / "configs" / "splits" / "persona_splits.v1.json"


def write(path: Path, value: object) -> Path:
    path.write_text(json.dumps(value), encoding="utf-8")
    return path


def test_golden_vectors() -> None:
    assert episode_seed(42, 2, 0) == 601474708
    assert episode_seed(42, 5, 1) == 1831969092
    assert episode_seed(20260830, 0, 0) == 700474123
    assert episode_id_for(12, 1) == "task-000012__sample-001"
    assert canonical_json({"b": "中", "a": 1}) == '{"a":1,"b":"中"}'
    assert fingerprint({"b": "中", "a": 1}) == "2831299868169bc527f55f88ebbdcd8b785d78d9e7dc64e6887dfbd2825dd247"
    assert fingerprint("shop") == "690848f6824adb47d2212cede03fca5b4212b0b09c2bc69cd02753de8be7b7c3"
    assert fingerprint({"provider": "none"}) == "97f46cc9d0ac3cb92ba1b8d839335e7c4ccacf252b518403903c1d108d64adc0"


def test_e1_sampled_plan_matches_reference() -> None:
    jobs = build_jobs(EvaluationPlan(split="val", task_ids=(2, 5, 9, 11), seed=42, sample_size=2, repeats=3))
    assert [(j.task_id, j.sample_id, j.seed) for j in jobs] == [
        (2, 0, 601474708),
        (2, 1, 2538819599),
        (2, 2, 3494624964),
        (11, 0, 2306725763),
        (11, 1, 1700471070),
        (11, 2, 1228260246),
    ]
    assert {j.sample_id for j in jobs} == {0, 1, 2}
    assert len({j.seed for j in jobs}) == 6


def test_t1_explicit_ids_with_gaps_and_persona(tmp_path: Path) -> None:
    path = write(tmp_path / "s.json", {"version": "x", "splits": {"val": {"task_ids": [1, 4, 8], "persona": True}}})
    split = load_task_split(path, "val")
    assert split.task_ids == (1, 4, 8) and split.persona is True
    assert "source_path" not in split.identity() and str(tmp_path) not in json.dumps(split.identity())


def test_legacy_range_split(tmp_path: Path) -> None:
    path = write(tmp_path / "s.json", {"corpus_size": 10, "splits": {"eval": {"start": 2, "end": 5, "persona": False}}})
    assert load_task_split(path, "eval").task_ids == (2, 3, 4)
    bad = write(tmp_path / "b.json", {"corpus_size": 4, "splits": {"eval": {"start": 2, "end": 5}}})
    with pytest.raises(SplitError, match="exceeds corpus_size"):
        load_task_split(bad, "eval")


def test_real_split_file_verifies() -> None:
    for name, count in (("train", 3726), ("val", 400), ("test", 400)):
        split = load_task_split(SPLITS, name)
        assert len(split.task_ids) == count and split.persona is True and split.role == name
    assert load_task_split(SPLITS, "test").is_test and not load_task_split(SPLITS, "val").is_test


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s["task_ids"].append(999999), "task_ids_sha256 does not match|task_count"),
        (lambda s: s.update(task_count=3), "task_count"),
        (lambda s: s["task_ids"].__setitem__(0, -1), r"task_ids\[0\]"),
        (lambda s: s["task_ids"].append(s["task_ids"][0]), "more than once"),
        (lambda s: s.update(persona="yes"), "persona"),
    ],
)
def test_split_errors_name_the_field(tmp_path: Path, mutate, message: str) -> None:
    document = json.loads(SPLITS.read_text(encoding="utf-8"))
    mutate(document["splits"]["val"])
    with pytest.raises(SplitError, match=message):
        load_task_split(write(tmp_path / "s.json", document), "val")


def test_split_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SplitError, match=r"not found.*available: a"):
        load_task_split(write(tmp_path / "s.json", {"splits": {"a": {"task_ids": [1]}}}), "b")
    (tmp_path / "bad.json").write_text('{"splits": {', encoding="utf-8")
    with pytest.raises(SplitError, match="line 1"):
        load_task_split(tmp_path / "bad.json", "a")
    with pytest.raises(SplitError, match="cannot read"):
        load_task_split(tmp_path / "missing.json", "a")


def test_task_ids_digest_convention() -> None:
    assert task_ids_sha256([1, 2]) == __import__("hashlib").sha256(b"[1,2]").hexdigest()


def test_plan_validation() -> None:
    with pytest.raises(PlanError):
        EvaluationPlan(split="v", task_ids=(), seed=1)
    with pytest.raises(PlanError):
        EvaluationPlan(split="v", task_ids=(1, 2), seed=1, sample_size=3)
    with pytest.raises(PlanError):
        EvaluationPlan(split="v", task_ids=(1,), seed=1, repeats=0)


def test_shard_map_is_balanced_and_complete() -> None:
    jobs = build_jobs(EvaluationPlan(split="val", task_ids=tuple(range(103)), seed=7, repeats=2))
    shards = shard_jobs(jobs, 8)
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(jobs)
    assert sorted(j.episode_id for s in shards for j in s) == sorted(j.episode_id for j in jobs)
    assert shard_jobs(jobs, 8) == shards
    with pytest.raises(PlanError):
        shard_jobs(jobs[:3], 4)


@pytest.mark.slow
def test_planning_is_identical_across_processes() -> None:
    code = (
        "import json,sys;from shopsimrl.planning import *;from shopsimrl.tasks import load_task_split;"
        f"s=load_task_split({str(SPLITS)!r},'train');"
        "j=build_jobs(EvaluationPlan('train',s.task_ids,20260830,sample_size=500,repeats=2));"
        "print(json.dumps([x.to_dict() for x in j]))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1
    jobs = [EpisodeJob.from_dict(d) for d in json.loads(outputs.pop())]
    assert len(jobs) == 1000 and jobs[0].seed == episode_seed(20260830, jobs[0].task_id, 0)


def test_test_guard_cannot_be_sidestepped(tmp_path: Path) -> None:
    path = write(
        tmp_path / "s.json",
        {
            "splits": {
                "Held": {"task_ids": [1, 2], "role": "Test"},
                "copy": {"task_ids": [2, 3], "role": "val"},
                "clean": {"task_ids": [4, 5], "role": "val"},
                "TEST": {"task_ids": [9]},
            }
        },
    )
    assert load_task_split(path, "Held").is_test  # role in another case
    assert load_task_split(path, "copy").is_test  # re-lists a held-out task under another role
    assert load_task_split(path, "TEST").is_test  # the name, in another case
    assert not load_task_split(path, "clean").is_test

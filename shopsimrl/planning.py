"""Deterministic job planning: task selection, per-episode seeds and the shard map.

Bit-compatible with the earlier implementation, so frozen job lists carry over:
- no ``sample_size``: every task of the split in file order; otherwise
  ``random.Random(seed).sample(task_ids, sample_size)`` in sample order (CPython's algorithm);
- jobs are task-major, ``sample_id`` 0…repeats-1;
- ``seed = int.from_bytes(sha256(f"{seed}:{task_id}:{sample_id}")[:4], "big")``.

The shard map assigns job *k* (in plan order) to shard ``k % shards``: balanced to within one job,
and repeats of one task land on different shards. It is recorded with the run, but it is an
execution choice and never part of the plan fingerprint.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from shopsimrl.schemas import EpisodeJob

_Job = TypeVar("_Job")  # a job or its episode id (sharded.layout splits the ids by the same rule)

__all__ = ["SHARD_ASSIGNMENT", "EvaluationPlan", "PlanError", "build_jobs", "episode_seed", "shard_jobs"]

SHARD_ASSIGNMENT = "round-robin-v1"


class PlanError(ValueError):
    """The plan parameters are inconsistent (empty split, bad sample size, bad repeats)."""


def episode_seed(experiment_seed: int, task_id: int, sample_id: int) -> int:
    digest = hashlib.sha256(f"{experiment_seed}:{task_id}:{sample_id}".encode("ascii")).digest()
    return int.from_bytes(digest[:4], "big")


@dataclass(frozen=True)
class EvaluationPlan:
    split: str
    task_ids: tuple[int, ...]
    seed: int
    sample_size: int | None = None
    repeats: int = 1

    def __post_init__(self) -> None:
        if not self.task_ids:
            raise PlanError("the split has no tasks")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise PlanError(f"tasks.repeats must be an integer >= 1, got {self.repeats!r}")
        if self.sample_size is not None and not 1 <= self.sample_size <= len(self.task_ids):
            raise PlanError(
                f"tasks.sample_size must be between 1 and the split size {len(self.task_ids)}, got {self.sample_size}"
            )

    def selected_task_ids(self) -> list[int]:
        if self.sample_size is None:
            return list(self.task_ids)
        return random.Random(self.seed).sample(list(self.task_ids), self.sample_size)


def build_jobs(plan: EvaluationPlan) -> list[EpisodeJob]:
    return [
        EpisodeJob(task_id=task_id, sample_id=sample_id, seed=episode_seed(plan.seed, task_id, sample_id), split=plan.split)
        for task_id in plan.selected_task_ids()
        for sample_id in range(plan.repeats)
    ]


def shard_jobs(jobs: Sequence[_Job], shards: int) -> list[list[_Job]]:
    """Split the plan into ``shards`` balanced, deterministic lists (plan order kept within each)."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise PlanError(f"shard count must be an integer >= 1, got {shards!r}")
    if shards > len(jobs):
        raise PlanError(f"{shards} shards for {len(jobs)} jobs would leave shards empty; use at most {len(jobs)}")
    return [list(jobs[index::shards]) for index in range(shards)]

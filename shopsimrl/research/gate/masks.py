"""Which skill chunks each masked rollout gets: the two randomisations of the earlier
implementation, bit for bit, so frozen gates carry over.

Gate A (cold start), one column per draft chunk, each included with probability 1/2::

    bit = int.from_bytes(sha256(f"{mask_seed}:{split}:{task_id}:{sample_id}:{chunk_id}")[:8], "big") < 2**63

The online gate, one slot per family (a current chunk with its REWRITE candidates, or one ADD
candidate); each slot is absent or shows exactly one of its versions, uniformly::

    choice = int.from_bytes(sha256(f"{mask_seed}:{split}:{task_id}:{sample_id}:{slot_id}")[:8], "big") % (versions + 1)

where 0 is absent and k the k-th version. A slot with one version is a fair coin again. The mask is
the 0/1 vector over all versions (columns, slot by slot); ``included_chunk_ids`` lists the shown
versions in column order, which is the order they are injected in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from shopsimrl.schemas import EpisodeJob

__all__ = [
    "MASK_PROBABILITY",
    "MASK_THRESHOLD",
    "Assignment",
    "Slot",
    "chunk_bit",
    "gate_a_assignments",
    "online_assignments",
    "slot_choice",
]

MASK_PROBABILITY: Final = 0.5
MASK_THRESHOLD: Final = int(MASK_PROBABILITY * (1 << 64))
"""A draw below this includes the chunk: 2**63."""


def _draw(seed: int, job: EpisodeJob, name: str) -> int:
    text = f"{seed}:{job.split}:{job.task_id}:{job.sample_id}:{name}"
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def chunk_bit(mask_seed: int, job: EpisodeJob, chunk_id: str) -> int:
    """Gate A: 1 when the chunk is shown in this rollout."""
    return int(_draw(mask_seed, job, chunk_id) < MASK_THRESHOLD)


def slot_choice(mask_seed: int, job: EpisodeJob, slot_id: str, versions: int) -> int:
    """Online gate: 0 for absent, k for the k-th of the slot's ``versions`` versions."""
    return _draw(mask_seed, job, slot_id) % (versions + 1)


@dataclass(frozen=True)
class Assignment:
    """One masked rollout's treatment."""

    job: EpisodeJob
    mask: tuple[int, ...]
    included: tuple[str, ...]
    slot_states: dict[str, str | None] | None = None
    """Online gate: per slot the version shown, or None (absent)."""

    def to_dict(self) -> dict[str, Any]:
        """The row of ``mask_assignments.json``."""
        row: dict[str, Any] = {
            "episode_id": self.job.episode_id,
            **self.job.to_dict(),
            "mask": list(self.mask),
            "included_chunk_ids": list(self.included),
        }
        if self.slot_states is not None:
            row["slot_states"] = dict(self.slot_states)
        return row


def gate_a_assignments(jobs: Sequence[EpisodeJob], chunk_ids: Sequence[str], mask_seed: int) -> list[Assignment]:
    assignments = []
    for job in jobs:
        mask = tuple(chunk_bit(mask_seed, job, chunk_id) for chunk_id in chunk_ids)
        assignments.append(Assignment(job, mask, tuple(c for c, bit in zip(chunk_ids, mask, strict=True) if bit)))
    return assignments


@dataclass(frozen=True)
class Slot:
    slot_id: str
    versions: tuple[str, ...]
    old_version_id: str | None
    """The current chunk of a family; None for an ADD candidate's own slot."""


def online_assignments(jobs: Sequence[EpisodeJob], slots: Sequence[Slot], mask_seed: int) -> list[Assignment]:
    columns = [version for slot in slots for version in slot.versions]
    assignments = []
    for job in jobs:
        states: dict[str, str | None] = {}
        for slot in slots:
            choice = slot_choice(mask_seed, job, slot.slot_id, len(slot.versions))
            states[slot.slot_id] = None if choice == 0 else slot.versions[choice - 1]
        shown = set(states.values())
        mask = tuple(int(column in shown) for column in columns)
        assignments.append(Assignment(job, mask, tuple(c for c in columns if c in shown), states))
    return assignments

"""The one rule that picks each episode's winning record among its attempts.

Every reader of a run (the local ``traces.jsonl``, the reducer of sharded parts, the research
readers) reads records in their reading order (file order; part order, then line order) and
hands them to :class:`WinnerPicker`. The rule:

1. a completed record (:attr:`EpisodeTrace.completed`) beats every unfinished one, and the first
   completed record in reading order wins; later completed records of the episode are
   duplicates (a replaced pod, a retried write), counted and never scored twice;
2. without a completed record, the unfinished attempt with the highest ``attempt`` wins, then
   the latest ``ended_at``, then the one read later. ``attempt`` is the scheduler's count over
   every invocation, so it orders attempts even where reading order does not (parts sort by
   writer id, not by time); records of the earlier implementation carry none and count as 0.

Every other record is a superseded attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from shopsimrl.records.trace import EpisodeTrace

__all__ = ["Offer", "Verdict", "WinnerPicker"]

T = TypeVar("T")


class Verdict(Enum):
    COMPLETED = "completed"
    """The episode's winner: its first completed record."""
    DUPLICATE = "duplicate"
    """A further completed record of an episode that already has one."""
    UNFINISHED = "unfinished"
    """An unfinished attempt: the best so far, or a superseded one (then it is the ``loser``)."""


@dataclass(frozen=True)
class Offer(Generic[T]):
    verdict: Verdict
    loser: T | None
    """The item this record showed to be a superseded attempt (possibly its own), else None."""


@dataclass
class _Waiting(Generic[T]):
    rank: tuple[int, str]
    order: int
    item: T


class WinnerPicker(Generic[T]):
    """Applies the winner rule to records offered in reading order, one pass, holding one item
    per episode (what the caller needs of the record: its file offset, a small view)."""

    def __init__(self) -> None:
        self.completed: dict[str, T] = {}
        """Per episode with a completed record: the item of the first one."""
        self._waiting: dict[str, _Waiting[T]] = {}
        self._offered = 0

    def offer(self, record: EpisodeTrace, item: T) -> Offer[T]:
        episode_id = record.episode_id
        self._offered += 1
        if record.completed:
            if episode_id in self.completed:
                return Offer(Verdict.DUPLICATE, None)
            self.completed[episode_id] = item
            waiting = self._waiting.pop(episode_id, None)
            return Offer(Verdict.COMPLETED, None if waiting is None else waiting.item)
        if episode_id in self.completed:
            return Offer(Verdict.UNFINISHED, item)
        candidate = _Waiting(record.attempt_rank, self._offered, item)
        waiting = self._waiting.get(episode_id)
        if waiting is not None and waiting.rank > candidate.rank:  # ties: the record read later wins
            return Offer(Verdict.UNFINISHED, item)
        self._waiting[episode_id] = candidate
        return Offer(Verdict.UNFINISHED, None if waiting is None else waiting.item)

    def winner(self, episode_id: str) -> T | None:
        """The item of the episode's winning record so far, None when none was offered."""
        if episode_id in self.completed:
            return self.completed[episode_id]
        waiting = self._waiting.get(episode_id)
        return None if waiting is None else waiting.item

    def unfinished(self) -> list[T]:
        """The winners of episodes without a completed record, in the reading order of those records."""
        return [waiting.item for waiting in sorted(self._waiting.values(), key=lambda w: w.order)]

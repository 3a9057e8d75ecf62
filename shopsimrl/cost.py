"""What a run cost: tokens over every attempt, the time it kept the model server busy, and money.

Tokens are what the model server reported (``usage``) in every record of the run: completed
episodes, failed ones, superseded attempts and duplicate records alike (the server did the work
for each). ``cost.tokens`` stays the reference-compatible sum over completed episodes only.

**Active time** is how long the run had at least one episode in flight: the union of the
``[started_at, ended_at]`` spans of every record, where a gap of up to :data:`BRIDGED_GAP_S`
between spans counts as active (the server is held between the episodes of an invocation) and
a longer one (between invocations, a paused Job) does not. It is wall time, never a sum of
episode durations: episodes in flight together, in one process or in many shards, count once.
It leaves out what happens before the first episode and after the last (loading the model,
waiting for pods).

**Accelerator hours** = active hours × ``cost.accelerators`` × ``cost.server_share``: the
model server's accelerators, for as long as this run used them, times this run's share of the
server. **Money** = prompt and completion tokens × their price per million, plus accelerator
hours × ``cost.accelerator_per_hour``; each part only when its price is configured. Prices come
from the run's manifest (``execution.cost``, recorded when the run was created), so every
summary of one run prices it the same way.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from shopsimrl.config import CostSection

__all__ = ["BRIDGED_GAP_S", "MAX_SPANS", "ActiveTime", "cost_block", "read_pricing", "unapplied_prices"]

BRIDGED_GAP_S = 60.0
"""A pause without an episode in flight up to this long still counts as active time."""
MAX_SPANS = 4096
"""Disjoint spans :class:`ActiveTime` keeps; past it the two closest are joined (the gap between
them counted as active, and the seconds so added reported)."""
_MILLION = 1_000_000


class ActiveTime:
    """The union of time spans (seconds since the epoch), gaps up to ``bridge_s`` joined.

    Memory follows the number of pauses longer than ``bridge_s``, not the number of episodes:
    records of one invocation overlap or follow each other closely and join into one span."""

    def __init__(self, bridge_s: float = BRIDGED_GAP_S, max_spans: int = MAX_SPANS) -> None:
        self.bridge_s = bridge_s
        self.max_spans = max_spans
        self._starts: list[float] = []
        self._ends: list[float] = []
        self.bridged_over_limit_s = 0.0
        """Gap seconds counted as active because more than ``max_spans`` spans were apart."""

    def add_times(self, started_at: Any, ended_at: Any) -> None:
        """A record's span from its ISO timestamps; a record without both (or ending before it
        starts) adds nothing."""
        start, end = _epoch(started_at), _epoch(ended_at)
        if start is not None and end is not None and end >= start:
            self.add(start, end)

    def add(self, start: float, end: float) -> None:
        starts, ends, bridge = self._starts, self._ends, self.bridge_s
        i = bisect.bisect_right(starts, start)
        # Join the span before when this one starts within its bridge.
        if i > 0 and start <= ends[i - 1] + bridge:
            i -= 1
            start = starts[i]
            end = max(end, ends[i])
            del starts[i], ends[i]
        # Join every following span this one reaches.
        while i < len(starts) and starts[i] <= end + bridge:
            end = max(end, ends[i])
            del starts[i], ends[i]
        starts.insert(i, start)
        ends.insert(i, end)
        if len(starts) > self.max_spans:
            self._join_closest()

    def _join_closest(self) -> None:
        starts, ends = self._starts, self._ends
        gaps = [starts[k + 1] - ends[k] for k in range(len(starts) - 1)]
        k = min(range(len(gaps)), key=gaps.__getitem__)
        self.bridged_over_limit_s += gaps[k]
        ends[k] = max(ends[k], ends[k + 1])
        del starts[k + 1], ends[k + 1]

    @property
    def spans(self) -> int:
        return len(self._starts)

    def seconds(self) -> float | None:
        """Active seconds (bridged gaps included), None when no record had both timestamps."""
        if not self._starts:
            return None
        return math.fsum(end - start for start, end in zip(self._starts, self._ends, strict=True))


def _epoch(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None  # a naive time could be any zone: no span is better than a wrong one
    seconds = parsed.timestamp()
    return seconds if math.isfinite(seconds) else None


def read_pricing(execution: Mapping[str, Any] | None) -> tuple[CostSection | None, str | None]:
    """The prices recorded in a manifest's ``execution`` block, and a note when they cannot be
    read (then no money is computed; the tokens and times still are)."""
    value = (execution or {}).get("cost")
    if value is None:
        return None, None
    try:
        return CostSection.model_validate(value), None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'cost'}: {e['msg']}" for e in exc.errors())
        return None, f"the manifest's execution.cost is not a valid cost block ({problems}); no money computed"


def unapplied_prices(recorded: Mapping[str, Any], configured: Mapping[str, Any]) -> str | None:
    """What to warn when the config's ``cost:`` block differs from the prices the run was created
    with (two ``execution`` blocks); None when they agree. The manifest is frozen, so the run keeps
    its recorded prices; the summary's tokens and accelerator hours let anyone price it anew."""
    before, now = recorded.get("cost"), configured.get("cost")
    if before == now:
        return None
    return (
        f"the config's cost: block ({_describe(now)}) differs from the prices this run was created with "
        f"({_describe(before)}, the manifest's execution.cost): its summaries keep pricing it with those; "
        "tokens and accelerator hours are in the summary to price it otherwise"
    )


def _describe(value: Any) -> str:
    if not isinstance(value, Mapping):
        return "none"
    return ", ".join(f"{key} {item}" for key, item in value.items() if item is not None) or "none"


def cost_block(
    tokens_all_attempts: Mapping[str, int], active_seconds: float | None, pricing: CostSection | None, note: str | None = None
) -> dict[str, Any]:
    """The summary's added ``cost`` keys: tokens over every attempt, the prices used,
    accelerator hours and money (each null where its inputs are missing)."""
    notes = [note] if note else []
    accelerator_hours = None
    if pricing is not None and pricing.accelerators is not None and active_seconds is not None:
        accelerator_hours = active_seconds / 3600.0 * pricing.accelerators * pricing.server_share
    money: dict[str, Any] | None = None
    if pricing is not None and any(
        price is not None for price in (pricing.prompt_per_million, pricing.completion_per_million, pricing.accelerator_per_hour)
    ):
        items: dict[str, float | None] = {}
        for key, price in (
            ("prompt_tokens", pricing.prompt_per_million),
            ("completion_tokens", pricing.completion_per_million),
        ):
            if price is None:
                continue
            count = tokens_all_attempts.get(key)
            if count is None:
                notes.append(f"{key} priced, but the model server reported none: the total is unknown")
            items[key] = None if count is None else count / _MILLION * price
        if pricing.accelerator_per_hour is not None:
            if accelerator_hours is None:
                notes.append("accelerator time priced, but no record has both start and end times: the total is unknown")
            items["accelerator"] = None if accelerator_hours is None else accelerator_hours * pricing.accelerator_per_hour
        known = [amount for amount in items.values() if amount is not None]
        total = math.fsum(known) if len(known) == len(items) else None
        money = {"currency": pricing.currency, **items, "total": total}
    return {
        "tokens_all_attempts": dict(tokens_all_attempts),
        "pricing": None if pricing is None else pricing.model_dump(),
        "accelerator_hours": accelerator_hours,
        "money": money,
        "notes": notes,
    }

"""Slots shared by the members of an eval set: a total, a budget per shop (environment URL) and
one per model server (model URL).

A freed slot goes to the earliest member (set order) that has waiting episodes and whose shop
and model budgets have room, so the next member fills what a draining member frees.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

__all__ = ["MemberSlot", "SharedSlots", "SlotPool"]


@dataclass
class _Member:
    shop: str
    model: str
    waiting: int
    running: int = 0


@dataclass
class SlotPool:
    """``total`` slots; ``shop_budget``/``model_budget``: slots per URL (a URL not listed is
    bounded by the total only)."""

    total: int
    shop_budget: dict[str, int] = field(default_factory=dict)
    model_budget: dict[str, int] = field(default_factory=dict)
    _members: list[_Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.total < 1:
            raise ValueError("a slot pool needs at least one slot")

    def add(self, shop: str, model: str, waiting: int) -> int:
        """Register a member with ``waiting`` episodes; its index is its priority (0 first)."""
        self._members.append(_Member(shop, model, waiting))
        return len(self._members) - 1

    @property
    def busy(self) -> int:
        return sum(member.running for member in self._members)

    def _in_use(self, attribute: str, url: str) -> int:
        return sum(member.running for member in self._members if getattr(member, attribute) == url)

    def _fits(self, member: _Member) -> bool:
        shop_cap = self.shop_budget.get(member.shop, self.total)
        model_cap = self.model_budget.get(member.model, self.total)
        return self._in_use("shop", member.shop) < shop_cap and self._in_use("model", member.model) < model_cap

    def acquire(self) -> int | None:
        """Take a slot for the earliest member that can use one; its index, None when none can."""
        if self.busy >= self.total:
            return None
        for index, member in enumerate(self._members):
            if member.waiting and self._fits(member):
                member.waiting -= 1
                member.running += 1
                return index
        return None

    def release(self, index: int, *, requeue: bool = False) -> None:
        """Member ``index`` ends an episode (``requeue``: it is to run again, a retry)."""
        member = self._members[index]
        if member.running < 1:
            raise ValueError(f"member {index} holds no slot")
        member.running -= 1
        if requeue:
            member.waiting += 1

    def wait(self, index: int) -> None:
        """Member ``index`` has one more episode waiting for a slot."""
        self._members[index].waiting += 1

    def withdraw(self, index: int) -> None:
        """Member ``index`` no longer waits for one of its slots (the waiter was cancelled)."""
        member = self._members[index]
        if member.waiting < 1:
            raise ValueError(f"member {index} has no waiting episode")
        member.waiting -= 1

    def done(self, index: int) -> bool:
        member = self._members[index]
        return member.waiting == 0 and member.running == 0

    def fill(self) -> list[int]:
        """Every slot that can be handed out now, in order of the members that get them."""
        granted = []
        while (index := self.acquire()) is not None:
            granted.append(index)
        return granted


class SharedSlots:
    """:class:`SlotPool` for tasks on one event loop: :meth:`acquire` waits until the pool hands
    the member a slot. A member's waiting count is the number of its tasks waiting right now, so
    a member whose next attempt is in a retry backoff lets the later members use the slot."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self._waiters: list[deque[asyncio.Future[None]]] = []

    def add(self, shop: str = "", model: str = "") -> int:
        """Register a member (its priority is its order); its index for acquire/release."""
        self._waiters.append(deque())
        return self.pool.add(shop, model, 0)

    async def acquire(self, index: int) -> None:
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[index].append(granted)
        self.pool.wait(index)
        self._dispatch()
        try:
            await granted
        except asyncio.CancelledError:
            if not granted.cancelled():
                self.release(index)  # granted as it was cancelled: the slot goes to the next
            elif granted in self._waiters[index]:  # not yet dropped by _dispatch
                self._waiters[index].remove(granted)
                self.pool.withdraw(index)
            raise

    def release(self, index: int) -> None:
        self.pool.release(index)
        self._dispatch()

    def _dispatch(self) -> None:
        # A waiter cancelled since (its task not yet unwound) must not be handed a slot.
        for member, waiters in enumerate(self._waiters):
            for cancelled in [waiter for waiter in waiters if waiter.cancelled()]:
                waiters.remove(cancelled)
                self.pool.withdraw(member)
        while (granted := self.pool.acquire()) is not None:
            self._waiters[granted].popleft().set_result(None)


@dataclass(frozen=True)
class MemberSlot:
    """One member's view of :class:`SharedSlots` (the scheduler's ``EpisodeSlot``)."""

    shared: SharedSlots
    index: int

    async def acquire(self) -> None:
        await self.shared.acquire(self.index)

    def release(self) -> None:
        self.shared.release(self.index)

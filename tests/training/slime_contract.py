"""slime's ``Sample`` field contract, for tests that run without slime (torch, Ray).

The fields are those the adapter reads or fills on ``slime.utils.types.Sample`` (THUDM/slime
624b824; docs/training.md lists them); :func:`installed` puts this class where
:meth:`shopsimrl.training.samples.Sample.to_slime` imports it from, so the real conversion runs.
"""

from __future__ import annotations

import enum
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ContractSample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None

    def get_reward_value(self, args: Any) -> float:
        key = getattr(args, "reward_key", None)
        assert isinstance(self.reward, dict) if key else True
        value = self.reward[key] if key and isinstance(self.reward, dict) else self.reward
        assert isinstance(value, int | float)
        return float(value)


@contextmanager
def installed() -> Iterator[type[ContractSample]]:
    """``slime.utils.types.Sample`` is :class:`ContractSample` inside the block."""
    names = ("slime", "slime.utils", "slime.utils.types")
    saved = {name: sys.modules.get(name) for name in names}
    modules = {name: types.ModuleType(name) for name in names}
    modules["slime.utils.types"].Sample = ContractSample  # type: ignore[attr-defined]
    sys.modules.update(modules)
    try:
        yield ContractSample
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module

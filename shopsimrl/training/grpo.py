"""What slime does with a group of rollouts before training: the dynamic-sampling filter and the
GRPO normaliser, both aware of sibling samples (one rollout forked into several samples).

Point slime at them with::

    --dynamic-sampling-filter-path shopsimrl.training.grpo.fully_scored_group_filter
    --custom-reward-post-process-path shopsimrl.training.grpo.normalize_grpo_advantages

**The filter** (slime calls ``filter(args, group)`` per finished group, where ``group`` holds
what the custom-generate function returned per sample: a list of samples each, here) drops

- a group with an unscored sample (an abort placeholder: the episode failed for a technical
  reason), reason ``shopsim_unscored_technical_group``. Such groups never reach the trainer,
  even when too few remain; after ``filter.max_consecutive_unscored_groups`` such groups in a
  row it raises :class:`TrainingStalledError` (the shop or the model is down: stop, do not spin);
- a group whose rewards, one per rollout (siblings share theirs), spread by no more than
  ``filter.reward_spread`` (max − min): GRPO learns nothing from it. Reason
  ``shopsim_zero_std_group`` with ``keep_when_insufficient`` true, so slime keeps it rather than
  start another over-sampling round when too few groups remain (slime's ``DynamicFilterOutput``).

Inside slime's process the answer is slime's ``DynamicFilterOutput`` (slime wraps anything else
as ``keep=bool(output)``); elsewhere :class:`FilterDecision`, the same three fields. The filter
keeps each group's answer (:attr:`GroupFilter.decisions`, by ``group_index``) until the rollout
metrics take them (:mod:`shopsimrl.training.metrics`), which count the drops from them.

**The normaliser** (slime calls it with ``(args, samples)``, the flat list of a rollout step's
samples, and takes ``(raw_rewards, rewards)``, one per sample): per ``group_index``, one reward per
unique ``rollout_id`` (siblings must share it), centred on the group's mean and, with
``--grpo-std-normalization`` (slime's default), divided by the group's unbiased standard
deviation + 1e-6; a group of one rollout gets 0; every sibling gets its rollout's advantage.
Abort placeholders (``remove_sample``) count in no group and get 0 (slime masks their loss).
Values are computed in float64 and rounded to float32, the dtype slime's reward tensors hold, so
they equal :func:`shopsimrl.research.training.grpo_advantages` over the same rollouts within
float32 rounding.

Both refuse ``--rollout-top-p`` other than 1 and ``--rollout-top-k`` other than −1: the samples
carry no replay data of a truncated distribution.
"""

from __future__ import annotations

import math
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shopsimrl.config import ConfigError
from shopsimrl.training.config import FilterSection, config_path, load_training_config

__all__ = [
    "EPSILON",
    "FilterDecision",
    "GroupFilter",
    "TrainingStalledError",
    "flatten",
    "fully_scored_group_filter",
    "group_filter",
    "grpo_advantages_by_rollout",
    "is_scored",
    "normalize_grpo_advantages",
]

EPSILON = 1e-6
UNSCORED_REASON = "shopsim_unscored_technical_group"
ZERO_SPREAD_REASON = "shopsim_zero_std_group"


class TrainingStalledError(RuntimeError):
    """Too many groups in a row had an unscored sample: the shop or the model is failing."""


@dataclass
class FilterDecision:
    """slime's ``DynamicFilterOutput`` shape, outside slime's process."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def _decision(keep: bool, reason: str | None = None, keep_when_insufficient: bool = False) -> Any:
    try:  # slime's own type inside its process: it treats any other answer as a bare bool
        from slime.rollout.filter_hub.base_types import (  # type: ignore[import-not-found]  # only in the trainer
            DynamicFilterOutput,
        )
    except ImportError:
        return FilterDecision(keep, reason, keep_when_insufficient)
    return DynamicFilterOutput(keep=keep, reason=reason, keep_when_insufficient=keep_when_insufficient)


def _check_sampling(args: Any) -> None:
    top_p, top_k = getattr(args, "rollout_top_p", 1.0), getattr(args, "rollout_top_k", -1)
    if top_p != 1.0:
        raise ConfigError(f"--rollout-top-p must be 1.0, got {top_p!r}: the samples carry no top-p replay data")
    if top_k != -1:
        raise ConfigError(f"--rollout-top-k must be -1, got {top_k!r}: the samples carry no top-k replay data")


def flatten(group: Sequence[Any]) -> list[Any]:
    """A group as slime holds it (a sample per generate call, or a list of siblings per call), flat."""
    out: list[Any] = []
    for item in group:
        out.extend(item if isinstance(item, list) else [item])
    return out


def _status(sample: Any) -> str:
    status = getattr(sample, "status", None)
    return str(getattr(status, "value", status))


def _reward(sample: Any, key: str | None) -> float | None:
    """The sample's scalar reward (``reward[key]`` for a dict reward); None when there is none."""
    reward = getattr(sample, "reward", None)
    if isinstance(reward, dict):
        reward = reward.get(key or "reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        return None
    return float(reward)


def is_scored(sample: Any, key: str | None) -> bool:
    metadata = getattr(sample, "metadata", None) or {}
    return (
        not getattr(sample, "remove_sample", False)
        and _status(sample) != "aborted"
        and metadata.get("scored", True) is not False
        and _reward(sample, key) is not None
    )


def _rollout_of(sample: Any) -> int:
    """The sample's ``rollout_id``, else its ``index`` (slime's fallback)."""
    rollout = getattr(sample, "rollout_id", None)
    rollout = getattr(sample, "index", None) if rollout is None else rollout
    if not isinstance(rollout, int) or isinstance(rollout, bool):
        raise ValueError(f"sample {getattr(sample, 'index', None)} has neither rollout_id nor index")
    return rollout


def _rollout_rewards(samples: Sequence[Any], key: str | None) -> dict[int, float]:
    """One reward per ``rollout_id`` (the sample's ``index`` when unset); siblings must agree."""
    rewards: dict[int, float] = {}
    for sample in samples:
        rollout = _rollout_of(sample)
        reward = _reward(sample, key)
        assert reward is not None  # callers pass scored samples only
        if rollout in rewards and rewards[rollout] != reward:
            raise ValueError(
                f"siblings of rollout {rollout} disagree on the reward ({rewards[rollout]} and {reward}); "
                "a rollout has one reward"
            )
        rewards[rollout] = reward
    return rewards


class GroupFilter:
    """The filter with its state (the run of unscored groups); module docstring."""

    def __init__(self, settings: FilterSection | None = None) -> None:
        self.settings = settings or FilterSection()
        self.consecutive_unscored = 0
        self.decisions: dict[int, FilterDecision] = {}
        """``group_index`` → the answer given, until :meth:`take_decisions` (the metrics, once a step)."""
        # slime calls the filter on its rollout loop's thread and the metrics hook on another.
        self._lock = threading.Lock()

    def take_decisions(self) -> dict[int, FilterDecision]:
        """The answers given since the last call, by ``group_index``; forgets them."""
        with self._lock:
            taken, self.decisions = self.decisions, {}
        return taken

    def __call__(self, args: Any, group: Sequence[Any], **kwargs: Any) -> Any:
        _check_sampling(args)
        samples = flatten(group)
        decision = self._decide(args, samples)
        group_index = getattr(samples[0], "group_index", None) if samples else None
        if isinstance(group_index, int) and not isinstance(group_index, bool):
            with self._lock:
                self.decisions[group_index] = decision
        return _decision(decision.keep, decision.reason, decision.keep_when_insufficient)

    def _decide(self, args: Any, samples: list[Any]) -> FilterDecision:
        key = getattr(args, "reward_key", None)
        if not samples or not all(is_scored(sample, key) for sample in samples):
            self.consecutive_unscored += 1
            limit = self.settings.max_consecutive_unscored_groups
            if self.consecutive_unscored >= limit:
                raise TrainingStalledError(
                    f"{self.consecutive_unscored} groups in a row had an unscored sample (filter.max_consecutive_unscored_groups "
                    f"is {limit}): the shop or the model keeps failing; see the run's traces for the failures"
                )
            return FilterDecision(False, UNSCORED_REASON)
        self.consecutive_unscored = 0
        rewards = list(_rollout_rewards(samples, key).values())
        if max(rewards) - min(rewards) <= self.settings.reward_spread:
            return FilterDecision(False, ZERO_SPREAD_REASON, keep_when_insufficient=True)
        return FilterDecision(True)


_filters: dict[str, GroupFilter] = {}


def group_filter(args: Any) -> GroupFilter:
    """The process's filter of the training config slime's ``args`` name (one per config)."""
    path = str(config_path(args, dict(os.environ)).resolve())
    if path not in _filters:
        _filters[path] = GroupFilter(load_training_config(path).filter)
    return _filters[path]


def fully_scored_group_filter(args: Any, samples: Sequence[Any], **kwargs: Any) -> Any:
    """slime's ``--dynamic-sampling-filter-path`` function; its settings are the training config's
    ``filter`` section (found as the custom-generate function finds the config)."""
    return group_filter(args)(args, samples, **kwargs)


def _float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def grpo_advantages_by_rollout(rewards: dict[int, float], *, scale: bool = True, epsilon: float = EPSILON) -> dict[int, float]:
    """One group's advantage per rollout (float64): centred, divided by the unbiased std + ε when ``scale``."""
    if len(rewards) < 2:
        return dict.fromkeys(rewards, 0.0)
    values = list(rewards.values())
    mean = sum(values) / len(values)
    std = math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1))
    return {rollout: (reward - mean) / (std + epsilon) if scale else reward - mean for rollout, reward in rewards.items()}


def normalize_grpo_advantages(args: Any, samples: Sequence[Any]) -> tuple[list[float], list[float]]:
    """slime's ``--custom-reward-post-process-path`` function: ``(raw_rewards, advantages)``, one
    of each per sample, in order (module docstring)."""
    _check_sampling(args)
    key = getattr(args, "reward_key", None)
    scale = bool(getattr(args, "grpo_std_normalization", True))
    flat = flatten(samples)
    raw = [_reward(sample, key) or 0.0 for sample in flat]
    groups: dict[int, list[Any]] = {}
    for sample in flat:
        if not is_scored(sample, key):
            continue
        group = getattr(sample, "group_index", None)
        if not isinstance(group, int):
            raise ValueError(f"sample {getattr(sample, 'index', None)} has no group_index; GRPO groups by it")
        groups.setdefault(group, []).append(sample)
    advantages: dict[tuple[int, int], float] = {}
    for group, members in groups.items():
        for rollout, value in grpo_advantages_by_rollout(_rollout_rewards(members, key), scale=scale).items():
            advantages[(group, rollout)] = _float32(value)
    out: list[float] = []
    for sample in flat:
        if not is_scored(sample, key):
            out.append(0.0)
            continue
        out.append(advantages[(sample.group_index, _rollout_of(sample))])
    return raw, out

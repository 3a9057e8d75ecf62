"""A stand-in for one slime rollout step, for demos and tests without slime (torch, Ray, GPUs).

slime's rollout manager (THUDM/slime 624b824, ``slime/rollout/sglang_rollout.py`` and
``slime/ray/rollout.py``) does, per rollout step: take ``--over-sampling-batch-size`` prompts
from the prompt data, make ``--n-samples-per-prompt`` copies of each (one group, sharing
``group_index``), await the custom-generate function for every sample, hand each finished group
to the dynamic-sampling filter, stop once ``--rollout-batch-size`` groups are kept (refilling with
``keep_when_insufficient`` groups when too few pass), hand every generated group to the
all-samples hook, normalise the kept samples' rewards, and log the step's metrics through the
custom log function. :func:`play_round` does the same with the functions named by the same
flags, imported by dotted path as slime imports them, and slime's ``Sample`` replaced by
:class:`ContractSample` (the fields the adapter reads or fills), so the adapter's real
conversion runs.

What it does not do: train (no policy update, no weight sync), resume a partial rollout, or
batch prompts across steps. It is the shape of one step, for `make train-demo` and the tests.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
import json
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from shopsimrl.config import ConfigError

__all__ = ["ContractSample", "RoundResult", "installed", "play_round", "read_task_data"]


@dataclass
class ContractSample:
    """slime's ``Sample`` (``slime.utils.types``, 624b824): the fields the adapter reads or fills."""

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
        value = self.reward.get(key) if key and isinstance(self.reward, dict) else self.reward
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"sample {self.index}: reward {self.reward!r} has no number under {key!r}")
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


def _function(path: str) -> Callable[..., Any]:
    module, _, name = path.rpartition(".")
    function = getattr(importlib.import_module(module), name, None)
    if not callable(function):
        raise ValueError(f"{path} is not a function")
    return function  # type: ignore[no-any-return]


def read_task_data(path: str | Path, *, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` lines of slime's prompt data (``training prepare-data``), each checked."""
    rows: list[dict[str, Any]] = []
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if len(rows) == limit:
                break
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}, line {number}: not JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("metadata"), dict):
                raise ValueError(f"{path}, line {number}: a prompt-data line has a string prompt and a metadata object")
            rows.append(row)
    if len(rows) < limit:
        raise ValueError(f"{path} has {len(rows)} prompts; the round asks for {limit}")
    return rows


@dataclass
class RoundResult:
    groups: list[list[Any]]
    """Every generated group (what the all-samples hook saw), in group order."""
    kept: list[int]
    """The group indices handed to the trainer, in the order the filter kept them."""
    decisions: dict[int, dict[str, Any]]
    """Per group: ``keep``, ``reason``, ``keep_when_insufficient`` as the filter answered."""
    raw_rewards: list[float]
    advantages: list[float]
    """One per kept sample, in the order of ``kept`` (siblings flattened)."""
    metrics: dict[str, Any]


def _decision(answer: Any) -> dict[str, Any]:
    if isinstance(answer, bool):
        return {"keep": answer, "reason": None, "keep_when_insufficient": False}
    return {
        "keep": bool(answer.keep),
        "reason": getattr(answer, "reason", None),
        "keep_when_insufficient": bool(getattr(answer, "keep_when_insufficient", False)),
    }


def _flat(group: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for item in group:
        out.extend(item if isinstance(item, list) else [item])
    return out


async def play_round(
    args: SimpleNamespace,
    prompts: Sequence[dict[str, Any]],
    *,
    sampling_params: dict[str, Any],
    generate_path: str = "shopsimrl.training.slime_adapter.generate",
    filter_path: str | None = "shopsimrl.training.grpo.fully_scored_group_filter",
    all_samples_path: str | None = "shopsimrl.training.metrics.record_generated_rollout_groups",
    reward_post_process_path: str = "shopsimrl.training.grpo.normalize_grpo_advantages",
    log_path: str | None = "shopsimrl.training.metrics.enrich_rollout_metrics",
    rollout_id: int = 0,
) -> RoundResult:
    """One rollout step over ``prompts`` (one group each); module docstring."""
    generate = _function(generate_path)
    keep_filter = _function(filter_path) if filter_path else None
    n = args.n_samples_per_prompt
    with installed() as sample_type:

        async def one_group(group_index: int, prompt: dict[str, Any]) -> list[Any]:
            samples = [
                sample_type(
                    group_index=group_index,
                    index=group_index * n + i,
                    prompt=prompt["prompt"],
                    metadata=dict(prompt["metadata"]),
                )
                for i in range(n)
            ]
            return list(await asyncio.gather(*(generate(args, s, dict(sampling_params)) for s in samples)))

        pending = {asyncio.ensure_future(one_group(g, p)): g for g, p in enumerate(prompts)}
        groups: dict[int, list[Any]] = {}
        decisions: dict[int, dict[str, Any]] = {}
        kept: list[int] = []
        spare: list[int] = []
        try:
            for finished in asyncio.as_completed(list(pending)):
                group = await finished
                g = _flat(group)[0].group_index
                groups[g] = group
                decision = _decision(keep_filter(args, group) if keep_filter else True)
                decisions[g] = decision
                if decision["keep"]:
                    kept.append(g)
                elif decision["keep_when_insufficient"]:
                    spare.append(g)
                if len(kept) == args.rollout_batch_size:
                    break  # slime aborts the rollouts still running once the batch is full
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for g in spare:
            if len(kept) >= args.rollout_batch_size:
                break
            kept.append(g)
        ordered = [groups[g] for g in sorted(groups)]
        if all_samples_path:
            _function(all_samples_path)(args, ordered, None)
        flat = [sample for g in kept for sample in _flat(groups[g])]
        raw, advantages = _function(reward_post_process_path)(args, flat)
        metrics: dict[str, Any] = {}
        if log_path:
            # slime's log hook adds to slime's metric dict; True would mean "do not log it".
            _function(log_path)(rollout_id, args, flat, metrics, 0.0)
    return RoundResult(
        groups=ordered, kept=kept, decisions=decisions, raw_rewards=list(raw), advantages=list(advantages), metrics=metrics
    )


def slime_args(config: str | Path, *, samples_per_group: int, batch_groups: int, over_sampling_groups: int) -> SimpleNamespace:
    """The slime arguments the adapter and its hooks read, as the flags of docs/training.md set them."""
    return SimpleNamespace(
        shopsim_training_config=str(Path(config).resolve()),
        n_samples_per_prompt=samples_per_group,
        rollout_batch_size=batch_groups,
        over_sampling_batch_size=over_sampling_groups,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        reward_key="reward",
        grpo_std_normalization=True,
        partial_rollout=False,
        group_rm=False,
        sglang_router_ip=None,
        sglang_router_port=None,
    )


def _record(result: RoundResult, args: SimpleNamespace) -> dict[str, Any]:
    kept = set(result.kept)
    groups = []
    for group in result.groups:
        samples = _flat(group)
        g = samples[0].group_index
        groups.append(
            {
                "group_index": g,
                "task_id": samples[0].metadata.get("task_id"),
                "kept": g in kept,
                **result.decisions.get(g, {}),
                "samples": [
                    {
                        "index": s.index,
                        "rollout_id": s.rollout_id,
                        "status": s.status.value,
                        "remove_sample": s.remove_sample,
                        "reward": s.reward,
                        "response_length": s.response_length,
                        "trained_tokens": sum(s.loss_mask or []),
                        "episode_id": s.metadata.get("episode_id"),
                        "skills": s.metadata.get("skills"),
                    }
                    for s in samples
                ],
            }
        )
    flat = [s for g in result.kept for s in _flat(next(x for x in result.groups if _flat(x)[0].group_index == g))]
    return {
        "schema_version": "shopsimrl-slime-step-v1",
        "args": {k: v for k, v in vars(args).items() if k != "shopsim_training_config"},
        "config": args.shopsim_training_config,
        "groups": groups,
        "kept_groups": result.kept,
        "advantages": [
            {"group_index": s.group_index, "index": s.index, "rollout_id": s.rollout_id, "raw_reward": r, "advantage": a}
            for s, r, a in zip(flat, result.raw_rewards, result.advantages, strict=True)
        ],
        "metrics": result.metrics,
    }


def main(
    config: str,
    *,
    task_data: str,
    over_sampling_groups: int,
    batch_groups: int,
    samples_per_group: int,
    temperature: float,
    max_new_tokens: int,
    out: str,
) -> None:
    """``shopsimrl training step``: one step, its record written to ``out``, a table printed."""
    from shopsimrl.storage.local import atomic_write_json
    from shopsimrl.training import slime_adapter

    args = slime_args(
        config, samples_per_group=samples_per_group, batch_groups=batch_groups, over_sampling_groups=over_sampling_groups
    )
    try:
        prompts = read_task_data(task_data, limit=over_sampling_groups)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    params = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens}

    async def run() -> RoundResult:
        try:
            return await play_round(args, prompts, sampling_params=params)
        finally:
            await slime_adapter.close_workers()

    result = asyncio.run(run())
    record = _record(result, args)
    atomic_write_json(Path(out), record)
    for group in record["groups"]:
        by_rollout = {s["rollout_id"]: s for s in group["samples"]}  # siblings share the reward
        rewards = " ".join(f"{s['reward']['reward']:.2f}" if not s["remove_sample"] else "--" for s in by_rollout.values())
        verdict = "kept" if group["kept"] else f"dropped ({group.get('reason')})"
        print(f"group {group['group_index']:>3}  task {group['task_id']:>6}  rewards {rewards:<24} {verdict}")
    print(f"{len(result.kept)} of {len(result.groups)} groups kept, {len(result.advantages)} samples to train; record: {out}")
    for key in sorted(result.metrics):
        print(f"  {key} = {result.metrics[key]}")

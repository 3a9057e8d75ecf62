"""slime's custom-generate function: one ShopSimulator episode per sample, exact tokens back.

Point slime at it with ``--custom-generate-function-path shopsimrl.training.slime_adapter.generate``
(and the config: :mod:`shopsimrl.training.config`). slime (THUDM/slime,
``slime/rollout/sglang_rollout.py::generate_and_rm``) awaits ``generate(args, sample,
sampling_params, evaluation=...)`` for every sample of a group and accepts a ``Sample`` or a list
of them. This function:

1. refuses what it cannot train on, loudly (a :class:`~shopsimrl.config.ConfigError`, so the run
   stops instead of learning from it): evaluation rollouts, partial rollouts, a group reward
   model (``--group-rm``: the reward is the environment's), ``top_p`` ≠ 1 or ``top_k`` ≠ −1 (no
   replay data for a truncated distribution), a sample without a task id;
2. plays the sample's task once through the process's :class:`~shopsimrl.training.worker.
   TrainingWorker` (created on the first call; the token endpoint is the config's
   ``model.base_url``, else slime's router ``http://{sglang_router_ip}:{sglang_router_port}``; the
   chat tokenizer is the config's ``model.tokenizer``, for ``hf`` without ``tokenizer_path``
   slime's own ``--hf-checkpoint``), which saves the trace and the samples in the run directory;
   with a curriculum in the config, the episode's skills are the draw of the sample's
   ``group_index``, so every sample of a group plays with the same skills;
3. counts the sample in its group (``group_index``; ``args.n_samples_per_prompt`` samples a
   group): the group's last sample runs the all-wrong triage (:mod:`shopsimrl.training.triage`)
   before it returns;
4. returns the episode's samples converted to slime's ``Sample`` (copies of the one slime handed
   in): siblings of a forked trajectory share ``rollout_id`` (slime's sample index); an episode
   without a score (shop down, lease lost, model failing after its retries) returns the abort
   placeholder (``remove_sample``, status ``ABORTED``), never a zero reward to learn from.

The task id is ``sample.metadata["task_id"]`` (the task data's metadata), else ``int(sample.prompt)``.
slime is imported only inside the conversion (:meth:`Sample.to_slime`), so this module imports
without slime; ``convert`` lets a caller outside slime's process choose the output type.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shopsimrl.config import ConfigError
from shopsimrl.training.config import TrainingConfig, config_path, load_training_config
from shopsimrl.training.samples import Sample
from shopsimrl.training.worker import Sampling, TrainingWorker, tokenizer_for

__all__ = ["close_workers", "generate", "group_size_of", "task_id_of", "token_endpoint"]


@dataclass
class _Held:
    worker: TrainingWorker
    key: tuple[str, str, Sampling]


_workers: dict[int, _Held] = {}
"""One worker per event loop of the process (slime runs its rollouts on one loop)."""
_creating: dict[int, asyncio.Lock] = {}


def token_endpoint(config: TrainingConfig, args: Any) -> str:
    """``model.base_url``, else slime's router from ``args``; the missing argument is named."""
    if config.model.base_url is not None:
        return config.model.base_url
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    if not ip or not port:
        raise ConfigError("model.base_url is null and slime's args have no sglang_router_ip/sglang_router_port")
    return f"http://{ip}:{port}"


def task_id_of(sample: Any) -> int:
    """The task a slime sample asks for (module docstring); ConfigError naming the sample otherwise."""
    metadata = getattr(sample, "metadata", None) or {}
    raw = metadata.get("task_id") if isinstance(metadata, Mapping) else None
    if raw is None:
        raw = getattr(sample, "prompt", None)
    if isinstance(raw, bool):
        raw = None
    try:
        task_id = int(raw) if isinstance(raw, int | str) else None
    except ValueError:
        task_id = None
    if task_id is None or task_id < 0:
        raise ConfigError(
            f"sample {getattr(sample, 'index', None)}: no task id (metadata.task_id, or a prompt that is a task "
            f"number; got metadata {dict(metadata) if isinstance(metadata, Mapping) else metadata!r}, "
            f"prompt {getattr(sample, 'prompt', None)!r})"
        )
    return task_id


def group_size_of(args: Any) -> int:
    """slime's ``n_samples_per_prompt``: the samples of one group (triage waits for all of them)."""
    size = getattr(args, "n_samples_per_prompt", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"slime's args.n_samples_per_prompt must be a positive integer, got {size!r}")
    return size


def _refuse(args: Any, evaluation: bool) -> None:
    if evaluation:
        raise ConfigError("shopsimrl's slime adapter generates training rollouts only; evaluate with `shopsimrl run`")
    if getattr(args, "partial_rollout", False):
        raise ConfigError("--partial-rollout is not supported: an episode is played whole, never resumed")
    if getattr(args, "group_rm", False):
        raise ConfigError("--group-rm is not supported: the reward is the environment's, filled by the adapter")


async def _worker(args: Any, sampling: Sampling) -> TrainingWorker:
    loop = id(asyncio.get_running_loop())
    path = config_path(args, dict(os.environ)).resolve()
    lock = _creating.setdefault(loop, asyncio.Lock())
    async with lock:
        held = _workers.get(loop)
        config = held.worker.config if held else load_training_config(path)
        key = (str(path), token_endpoint(config, args), sampling)
        if held is not None:
            if held.key != key:
                raise ConfigError(
                    f"this rollout process plays {held.key[0]} at {held.key[1]} with {held.key[2]}; "
                    f"a sample asked for {key[0]} at {key[1]} with {key[2]} (one config and one sampling per process)"
                )
            return held.worker
        # Loading a real tokenizer takes a second or more: off the loop slime's other rollouts run on.
        tokenizer = await asyncio.to_thread(tokenizer_for, config, args)
        worker = TrainingWorker(config, base_url=key[1], sampling=sampling, tokenizer=tokenizer)
        await worker.start()
        _workers[loop] = _Held(worker, key)
        return worker


async def close_workers() -> None:
    """Close the worker of the running loop (its journal, connections, run lock)."""
    loop = id(asyncio.get_running_loop())
    _creating.pop(loop, None)
    held = _workers.pop(loop, None)
    if held is not None:
        await held.worker.aclose()


def _slime(sample: Sample, base: Any) -> Any:
    return sample.to_slime(base)


async def generate(
    args: Any,
    sample: Any,
    sampling_params: dict[str, Any],
    evaluation: bool = False,
    *,
    convert: Callable[[Sample, Any], Any] = _slime,
) -> list[Any]:
    """slime's custom-generate function (module docstring): the samples of one episode."""
    _refuse(args, evaluation)
    size = group_size_of(args)
    sampling = Sampling.from_slime(sampling_params)
    worker = await _worker(args, sampling)
    index = getattr(sample, "index", None)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ConfigError(f"slime sample has no usable index ({index!r}); the episode id is built from it")
    # The episode seed is sha256(run.seed:task:index), never slime's sampling_seed: with
    # deterministic inference slime sends the same seeds to every group (rollout_seed + position).
    rollout = await worker.rollout(
        task_id=task_id_of(sample),
        index=index,
        group_index=getattr(sample, "group_index", None),
        metadata={"run_dir": worker.store.location},
        group_size=size,
    )
    return [convert(item, sample) for item in rollout.samples]

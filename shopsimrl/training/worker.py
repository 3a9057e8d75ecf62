"""The training rollout process: a config, a run directory, the shop's leases, the token endpoint.

:class:`TrainingWorker` is what slime's rollout process holds (one per process): it opens the run
directory (:class:`~shopsimrl.training.store.TrainingRunStore`, held with a lock), starts the
lease journal in ``<run dir>/leases/`` exactly as an evaluation run does (it first releases the
leases a killed predecessor left, then journals every lease of this process), and plays one
episode per call of :meth:`TrainingWorker.rollout` with at most ``run.concurrency`` in flight.
Every rollout's trace and samples are saved before the call returns. Leases are released on every
path: the episode engine releases an episode's lease when it ends, fails or is cancelled (slime
cancels the rollouts it no longer needs), and :meth:`TrainingWorker.aclose` closes the journal.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shopsimrl.config import ConfigError
from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings
from shopsimrl.planning import episode_seed
from shopsimrl.prompts import PromptBuilder
from shopsimrl.runner.lease_journal import DirectoryJournalStorage, LeaseJournal, start_lease_tracking
from shopsimrl.schemas import EpisodeJob
from shopsimrl.skills import NoSkills, SkillProvider, open_skill_provider
from shopsimrl.tasks import TaskSplit, load_task_split
from shopsimrl.training.chat import ChatTokenizer
from shopsimrl.training.config import TrainingConfig
from shopsimrl.training.hf_tokenizer import HfChatTokenizer
from shopsimrl.training.rollout import EpisodeRollout, TrainingRollouts
from shopsimrl.training.store import TrainingRunStore
from shopsimrl.training.token_model import Sleep, TokenModel, TokenModelSettings

__all__ = ["Sampling", "TrainingWorker", "tokenizer_for"]


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters every rollout of a worker uses (slime's ``sampling_params``)."""

    temperature: float
    max_new_tokens: int
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def from_slime(cls, params: Mapping[str, Any]) -> Sampling:
        """From slime's ``sampling_params``; the missing key is named. ``top_p``/``top_k`` other
        than 1/−1 are refused later by :class:`TokenModelSettings` (no replay data)."""
        for key in ("temperature", "max_new_tokens"):
            if key not in params:
                raise ConfigError(f"slime's sampling_params has no {key!r}")
        return cls(
            temperature=params["temperature"],
            max_new_tokens=params["max_new_tokens"],
            top_p=params.get("top_p", 1.0),
            top_k=params.get("top_k", -1),
        )


def tokenizer_for(config: TrainingConfig, args: Any = None) -> ChatTokenizer:
    """The chat tokenizer ``model.tokenizer`` names: ``hf`` loads ``model.tokenizer_path`` (relative
    to the config file), else slime's ``args.hf_checkpoint`` (the directory slime loads its own
    tokenizer from); ``testbed`` needs the shopsimrl-testbed distribution. :class:`ConfigError`
    naming the key otherwise."""
    model = config.model
    if model.tokenizer == "testbed":
        try:
            chat_tokens = importlib.import_module("shopsimrl.testbed.chat_tokens")
        except ModuleNotFoundError as exc:
            raise ConfigError(
                f"model.tokenizer 'testbed' needs the shopsimrl-testbed distribution, which is not installed ({exc}); "
                "install shopsimrl[testbed], or set model.tokenizer: hf for a real model"
            ) from None
        tokenizer: ChatTokenizer = chat_tokens.TestbedChatTokenizer()
        return tokenizer
    if model.tokenizer_path is not None:
        path = config.resolve(model.tokenizer_path)
        if not path.is_dir():
            raise ConfigError(f"model.tokenizer_path {path} is not a directory (a Hugging Face tokenizer or checkpoint)")
        where = str(path)
    else:
        checkpoint = getattr(args, "hf_checkpoint", None)
        if not isinstance(checkpoint, str) or not checkpoint:
            raise ConfigError(
                "model.tokenizer is 'hf' but model.tokenizer_path is not set and there is no slime --hf-checkpoint "
                "(args.hf_checkpoint) to take it from; set model.tokenizer_path"
            )
        where = checkpoint
    return HfChatTokenizer.load(where, trust_remote_code=model.tokenizer_trust_remote_code)


class TrainingWorker:
    """One per rollout process (module docstring). ``await worker.start()`` before the first
    rollout, ``await worker.aclose()`` at the end."""

    def __init__(
        self,
        config: TrainingConfig,
        *,
        base_url: str,
        sampling: Sampling,
        tokenizer: ChatTokenizer | None = None,
        sleep: Sleep | None = None,
    ) -> None:
        self.config = config
        self.sampling = sampling
        self.split: TaskSplit = load_task_split(config.resolve(config.tasks.split_file), config.tasks.split)
        if self.split.is_test:
            raise ConfigError(f"tasks.split {self.split.name!r} is (or overlaps) the held-out test split; training never runs it")
        persona = config.environment.persona if config.environment.persona is not None else self.split.persona
        if persona is None:
            raise ConfigError(f"environment.persona is null and split {self.split.name!r} does not say; set environment.persona")
        if self.split.persona is not None and persona != self.split.persona:
            raise ConfigError(f"environment.persona is {persona} but split {self.split.name!r} is persona={self.split.persona}")
        self._task_ids = frozenset(self.split.task_ids)
        settings = TokenModelSettings(
            base_url=base_url,
            model=config.model.name,
            checkpoint_id=config.model.checkpoint_id,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            send_seed=config.model.send_seed,
            timeout=config.model.timeout,
            max_retries=config.model.max_retries,
            retry_backoff_seconds=config.model.retry_backoff_seconds,
        )
        self.model = TokenModel(settings, tokenizer or tokenizer_for(config), sleep=sleep or asyncio.sleep)
        e = config.environment
        self.environment = ShopSimulatorEnvironment(
            ShopSimulatorSettings(
                base_url=e.base_url,
                persona=persona,
                interaction_mode=e.interaction_mode,
                timeout=e.timeout,
                reset_timeout=e.reset_timeout,
                max_leases=e.max_leases,
                cleanup_grace_seconds=e.cleanup_grace_seconds,
                max_retries=e.max_retries - 1,
                expected_environment_version=e.expected_environment_version,
                expected_observation_version=e.expected_observation_version,
            )
        )
        prompts = PromptBuilder.from_config(
            system_prompt=config.prompt.system_prompt,
            system_prompt_file=config.resolve(config.prompt.system_prompt_file) if config.prompt.system_prompt_file else None,
        )
        skills: SkillProvider = (
            open_skill_provider(config.resolve(config.skills.path), max_skills=config.skills.max_skills)
            if config.skills.path
            else NoSkills()
        )
        self.rollouts = TrainingRollouts(
            model=self.model, environment=self.environment, prompts=prompts, skills=skills, max_steps=config.runtime.max_steps
        )
        self.store = TrainingRunStore(config.run_dir)
        self.journal = LeaseJournal(DirectoryJournalStorage(self.store.leases_dir), environment_url=e.base_url)
        self._gate = asyncio.Semaphore(config.run.concurrency)
        self._started = False

    async def start(self) -> None:
        """Hold the run directory, release what a killed predecessor left, start the journal."""
        self.store.acquire()
        try:
            await start_lease_tracking(
                self.environment,
                self.journal,
                concurrency=self.config.run.concurrency,
                processes=1,
                configured=self.config.environment.max_leases,
            )
        except BaseException:
            self.store.release()
            raise
        self._started = True

    def job(self, *, task_id: int, index: int, seed: int | None = None) -> EpisodeJob:
        """The episode of slime's sample ``index`` on ``task_id``: its id is unique in the run
        because slime's sample index is (``task-…__sample-<index>``)."""
        if task_id not in self._task_ids:
            raise ConfigError(f"task {task_id} is not in split {self.split.name!r} of {self.split.file_name}")
        chosen = episode_seed(self.config.run.seed, task_id, index) if seed is None else seed
        return EpisodeJob(task_id=task_id, sample_id=index, seed=chosen, split=self.split.name)

    async def rollout(
        self,
        *,
        task_id: int,
        index: int,
        group_index: int | None,
        seed: int | None = None,
        metadata: dict[str, Any] | None = None,
        skills: SkillProvider | None = None,
    ) -> EpisodeRollout:
        """Play one episode and save it (trace, then samples) before returning it."""
        if not self._started:
            raise RuntimeError("TrainingWorker.start() was not awaited")
        job = self.job(task_id=task_id, index=index, seed=seed)
        async with self._gate:
            rollout = await self.rollouts.run(job, index=index, group_index=group_index, metadata=metadata, skills=skills)
        # Shielded: a cancelled caller must not leave the trace written without its samples line.
        await asyncio.shield(asyncio.to_thread(self.store.save, rollout))
        return rollout

    async def aclose(self) -> None:
        try:
            await self.model.aclose()
            await self.environment.aclose()
            await self.journal.aclose()
        finally:
            self.store.release()
            self._started = False

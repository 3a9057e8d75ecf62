"""The training rollout process: a config, a run, the shop's leases, the token endpoint.

:class:`TrainingWorker` is what slime's rollout process holds (one per process): it opens the run
(:mod:`shopsimrl.training.store`: a local directory held with a lock, or an object store
location), starts the lease journal in the run's ``leases/`` exactly as an evaluation run does
(it first releases the leases a killed predecessor left, then journals every lease of this
process), and plays one episode per call of :meth:`TrainingWorker.rollout` with at most
``run.concurrency`` in flight. With ``curriculum:`` in the config, each episode's skills are the
draw of its group (:mod:`shopsimrl.training.curriculum`), and :meth:`TrainingWorker.full_skills`
hands out every chunk for a replay of a failed group. Every rollout's trace and samples are
durable before the call returns. A rollout told its group's size (slime's
``n_samples_per_prompt``) joins the group's triage (:mod:`shopsimrl.training.triage`): the
group's last sample runs the all-wrong triage before it returns, whose diagnostic rollout is
stored in the run's ``training/triage/diagnostics/`` (a run of the same layout). Leases are
released on every path: the episode engine releases an episode's lease when it ends, fails or is
cancelled (slime cancels the rollouts it no longer needs), and :meth:`TrainingWorker.aclose`
writes what is buffered and closes the journal.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shopsimrl import __version__
from shopsimrl.config import ConfigError
from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings
from shopsimrl.planning import episode_seed
from shopsimrl.prompts import PromptBuilder
from shopsimrl.runner.lease_journal import LeaseJournal, start_lease_tracking
from shopsimrl.schemas import EpisodeJob
from shopsimrl.skills import NoSkills, SkillProvider, open_skill_provider
from shopsimrl.storage.objectstore import RunLocationError
from shopsimrl.tasks import TaskSplit
from shopsimrl.training.chat import ChatTokenizer
from shopsimrl.training.config import TrainingConfig, training_split
from shopsimrl.training.curriculum import CurriculumSkills, SkillCurriculum, open_curriculum
from shopsimrl.training.hf_tokenizer import HfChatTokenizer
from shopsimrl.training.rollout import EpisodeRollout, TrainingRollouts
from shopsimrl.training.store import ObjectTrainingRunStore, RolloutStore, TrainingRunStore
from shopsimrl.training.token_model import Sleep, TokenModel, TokenModelSettings
from shopsimrl.training.triage import DIAGNOSTICS_DIR, GroupTriage, diagnostic_seed

__all__ = ["Sampling", "TrainingWorker", "open_rollout_store", "tokenizer_for"]


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
        self.split: TaskSplit
        self.split, persona = training_split(config)
        c = config.curriculum
        self.curriculum: SkillCurriculum | None = (
            open_curriculum(config.resolve(c.state), config.resolve(c.skillbank)) if c else None
        )
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
        self.store = open_rollout_store(config, self.split)
        self.diagnostics = open_rollout_store(config, self.split, under=DIAGNOSTICS_DIR.as_posix())
        self.triage = GroupTriage(
            config.run_location,
            run_name=config.name,
            full_skill_retry=config.triage.full_skill_retry,
            diagnose=self._diagnose,
            has_chunks=lambda: not isinstance(self.full_skills(), NoSkills),
        )
        self.journal = LeaseJournal(self.store.journal_storage(), environment_url=e.base_url)
        self._gate = asyncio.Semaphore(config.run.concurrency)
        self._started = False

    async def start(self) -> None:
        """Take the run, release what a killed predecessor left, start the journal."""
        await asyncio.to_thread(self.store.acquire)
        try:
            await asyncio.to_thread(self.diagnostics.acquire)
            await start_lease_tracking(
                self.environment,
                self.journal,
                concurrency=self.config.run.concurrency,
                processes=1,
                configured=self.config.environment.max_leases,
            )
        except BaseException:
            try:
                await self.diagnostics.aclose()
            finally:
                await self.store.aclose()
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
        group_size: int | None = None,
    ) -> EpisodeRollout:
        """Play one episode and save it (trace, then samples) before returning it.

        ``skills``: this episode's provider; default: with a curriculum, the draw of
        ``group_index`` (so every sample of a group gets the same skills), else the config's. A
        curriculum's assignment (state id, mode, chunk ids) goes into every sample's metadata as
        ``curriculum``; the trace records it as ``provenance.skills`` and the chunks it selected.
        With ``group_size`` (and a ``group_index``) the rollout counts in its group's triage: the
        group's last sample triages the group before it returns."""
        if not self._started:
            raise RuntimeError("TrainingWorker.start() was not awaited")
        job = self.job(task_id=task_id, index=index, seed=seed)
        if skills is None and self.curriculum is not None:
            if group_index is None:
                raise ConfigError(f"sample {index} has no group_index: the curriculum draws each group's skills by it")
            skills = self.curriculum.skills_for(group_index)
        if isinstance(skills, CurriculumSkills):
            metadata = {**(metadata or {}), "curriculum": skills.assignment.to_dict()}
        grouped = group_size is not None and group_index is not None
        self.store.started()
        played = False
        try:
            async with self._gate:
                rollout = await self.rollouts.run(job, index=index, group_index=group_index, metadata=metadata, skills=skills)
            played = True
            await self.store.commit(rollout)
        except BaseException:
            if not played:
                self.store.abandoned()
            # Cancelled by slime, or failed: the group will not be whole, so it is not triaged.
            if grouped:
                assert group_size is not None and group_index is not None
                self.triage.sample_lost(group_index, group_size, index)
            raise
        if grouped:
            assert group_size is not None and group_index is not None
            await self.triage.sample_finished(group_index, group_size, rollout, index=index)
        return rollout

    async def _diagnose(self, task_id: int, group_index: int) -> EpisodeRollout:
        """The triage diagnostic of a group: its task once more with every chunk, saved in the
        diagnostics run directory (sample number = the group index), never returned to slime."""
        seed = diagnostic_seed(self.config.run.seed, task_id, group_index)
        job = self.job(task_id=task_id, index=group_index, seed=seed)
        skills = self.full_skills()
        metadata: dict[str, Any] = {"triage_diagnostic": True, "triage_group": group_index}
        if isinstance(skills, CurriculumSkills):
            metadata["curriculum"] = skills.assignment.to_dict()
        self.diagnostics.started()
        played = False
        try:
            async with self._gate:
                rollout = await self.rollouts.run(
                    job, index=group_index, group_index=group_index, metadata=metadata, skills=skills
                )
            played = True
            await self.diagnostics.commit(rollout)
        finally:
            if not played:
                self.diagnostics.abandoned()
        return rollout

    def full_skills(self) -> SkillProvider:
        """Every curriculum chunk as one provider (mode ``full``), for replaying a group with all
        of them; without a curriculum, the config's skills provider."""
        if self.curriculum is None:
            return self.rollouts.skills
        return self.curriculum.full_skills()

    async def aclose(self) -> None:
        """Store what is buffered, close the connections and the journal, let go of the run;
        each step runs whatever the one before raised (the first error is raised at the end)."""
        try:
            try:
                await self.store.aclose()
            finally:
                await self.diagnostics.aclose()
        finally:
            try:
                await self.model.aclose()
                await self.environment.aclose()
                await self.journal.aclose()
            finally:
                self._started = False


def open_rollout_store(config: TrainingConfig, split: TaskSplit, *, under: str | None = None) -> RolloutStore:
    """The run ``run.output_dir`` names (or the run ``under`` it, as the triage's diagnostics): a
    local directory, or an object store location (its form is checked here, the store is first
    reached by :meth:`TrainingWorker.start`)."""
    if not config.on_object_store:
        return TrainingRunStore(config.run_dir / under if under else config.run_dir)
    identity = {
        "name": config.name if under is None else f"{config.name}/{under}",
        "model": {"name": config.model.name, "tokenizer": config.model.tokenizer},
        "tasks": {"split": split.name, "split_file": split.file_name, "task_count": len(split.task_ids)},
        "seed": config.run.seed,
        "shopsimrl": __version__,
    }
    location = f"{config.run_location}/{under}" if under else config.run_location
    try:
        return ObjectTrainingRunStore(
            location, identity=identity, flush_rollouts=config.run.flush_rollouts, flush_seconds=config.run.flush_seconds
        )
    except RunLocationError as exc:
        raise ConfigError(f"run.output_dir: {exc}") from None

"""From a loaded config to the parts of a run: split, jobs, semantic plan, model, environment, runtime.

``prepare`` does no network I/O, so ``shopsimrl plan`` is instant and offline; ``check_services``
probes the model's ``/models`` and the environment's ``/healthz`` for ``plan --check`` and
``wait-ready``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from shopsimrl.config import ConfigError, ExperimentConfig
from shopsimrl.environment import (
    EnvironmentVersionError,
    ShopSimulatorEnvironment,
    ShopSimulatorSettings,
    SlotUsage,
    lease_budget,
)
from shopsimrl.episode import ACTION_PROTOCOL, AgentRuntime
from shopsimrl.inflight import AdaptiveLimit
from shopsimrl.model import OpenAICompatibleChatModel, OpenAICompatibleSettings
from shopsimrl.planning import EvaluationPlan, build_jobs
from shopsimrl.prompts import PromptBuilder
from shopsimrl.schemas import FINGERPRINT_VERSION, PIPELINE_VERSION, EpisodeJob, redact_uri
from shopsimrl.skills import NoSkills, SkillProvider, open_skill_provider
from shopsimrl.tasks import TaskSplit, load_task_split

__all__ = [
    "PreparedExperiment",
    "ServiceCheck",
    "check_services",
    "poll_until_ready",
    "prepare",
    "probe_environment",
    "probe_model",
]


def _model_settings(config: ExperimentConfig) -> OpenAICompatibleSettings:
    m = config.model
    return OpenAICompatibleSettings(
        model=m.name,
        base_url=m.base_url,
        api_key_env=m.api_key_env,
        checkpoint_id=m.checkpoint_id,
        temperature=m.temperature,
        max_tokens=m.max_tokens,
        top_p=m.top_p,
        timeout=m.timeout,
        max_retries=m.max_retries,
        retry_backoff_seconds=m.retry_backoff_seconds,
        stream=m.stream,
        send_seed=m.send_seed,
        tool_choice=m.tool_choice,
        extra_body=dict(m.extra_body),
        trust_env=m.trust_env,
        assistant_content_empty_string=m.assistant_content_empty_string,
    )


def _environment_settings(config: ExperimentConfig, persona: bool) -> ShopSimulatorSettings:
    e = config.environment
    return ShopSimulatorSettings(
        base_url=e.base_url,
        persona=persona,
        interaction_mode=e.interaction_mode,
        timeout=e.timeout,
        reset_timeout=e.reset_timeout,
        max_leases=e.max_leases,
        cleanup_grace_seconds=e.cleanup_grace_seconds,
        # The config counts total attempts (as model.max_retries does); the adapter counts extra ones.
        max_retries=e.max_retries - 1,
        expected_environment_version=e.expected_environment_version,
        expected_observation_version=e.expected_observation_version,
    )


@dataclass
class PreparedExperiment:
    config: ExperimentConfig
    split: TaskSplit
    persona: bool
    jobs: list[EpisodeJob]
    prompts: PromptBuilder
    skills: SkillProvider
    model_settings: OpenAICompatibleSettings
    environment_settings: ShopSimulatorSettings
    final_test: bool = False
    _plan: dict[str, Any] | None = field(default=None, repr=False)

    def model(self, limit: AdaptiveLimit | None = None) -> OpenAICompatibleChatModel:
        return OpenAICompatibleChatModel(self.model_settings, limit=limit)

    def environment(self) -> ShopSimulatorEnvironment:
        return ShopSimulatorEnvironment(self.environment_settings)

    def runtime(self, model: Any, environment: Any) -> AgentRuntime:
        return AgentRuntime(
            model=model,
            environment=environment,
            prompts=self.prompts,
            skills=self.skills,
            max_steps=self.config.runtime.max_steps,
            max_model_seconds=self.config.runtime.max_model_seconds,
        )

    def plan(self) -> dict[str, Any]:
        """The semantic plan: only what changes outputs (see docs/runtime_eval.md)."""
        if self._plan is None:
            # Both adapters open connections lazily, so identity-only instances cost nothing.
            model_identity = OpenAICompatibleChatModel(self.model_settings).semantic_identity()
            environment_identity = ShopSimulatorEnvironment(self.environment_settings).semantic_identity()
            self._plan = {
                "pipeline_version": PIPELINE_VERSION,
                "fingerprint_version": FINGERPRINT_VERSION,
                "experiment": self.config.name,
                "model_id": self.config.model_id,
                "model": model_identity,
                "task_split": self.split.identity(),
                "sampling": {
                    "seed": self.config.experiment.seed,
                    "sample_size": self.config.tasks.sample_size,
                    "repeats": self.config.tasks.repeats,
                },
                "jobs": [job.to_dict() for job in self.jobs],
                "environment": environment_identity,
                "runtime": self._runtime_identity(),
                "prompt": self.prompts.identity(),
                "skills": self.skills.identity(),
                "test_guard": {"held_out_split": self.split.is_test, "final_test": self.final_test},
            }
        return self._plan

    def _runtime_identity(self) -> dict[str, Any]:
        runtime: dict[str, Any] = {"max_steps": self.config.runtime.max_steps, "action_protocol": ACTION_PROTOCOL}
        if self.config.runtime.max_model_seconds is not None:
            # Only when set: a plan without a time limit keeps the fingerprint it always had.
            runtime["max_model_seconds"] = self.config.runtime.max_model_seconds
        return runtime

    def execution(self) -> dict[str, Any]:
        """Settings recorded for the audit trail but never fingerprinted; ``overrides``: the values
        that replaced the YAML's (command line, ``SHOPSIMRL_*``), when there are any; ``cost``, the
        prices every summary of the run is priced with (only when the config has a ``cost:`` block)."""
        overrides = [override.as_record() for override in self.config.overrides]
        prices = {} if self.config.cost is None else {"cost": self.config.cost.model_dump()}
        return {
            "concurrency": self.config.experiment.concurrency,
            "model_base_url": redact_uri(self.model_settings.base_url),
            "environment_base_url": redact_uri(self.environment_settings.base_url),
            "model_timeout_s": self.model_settings.timeout,
            "model_max_attempts": self.model_settings.max_retries,
            "environment_timeout_s": self.environment_settings.timeout,
            "max_episode_retries": self.config.runtime.max_episode_retries,
            **({"overrides": overrides} if overrides else {}),
            **prices,
        }


def prepare(config: ExperimentConfig, *, final_test: bool = False) -> PreparedExperiment:
    split = load_task_split(config.resolve(config.tasks.split_file), config.tasks.split)

    if split.is_test and not final_test:
        what = "is the held-out test split" if not split.overlaps_test else "shares tasks with the held-out test split"
        raise ConfigError(f"split {split.name!r} {what}; running it needs the explicit --final-test flag")
    if final_test and not split.is_test:
        raise ConfigError(f"--final-test is only for the held-out test split; {split.name!r} has role {split.role!r}")
    if final_test and config.skills.path is not None:
        raise ConfigError("a --final-test run must use skills.path: null (skills are selected on val, never on test)")

    persona = config.environment.persona
    if persona is None:
        if split.persona is None:
            raise ConfigError(
                f"environment.persona is null and split {split.name!r} does not say whether it is a persona split; set environment.persona"
            )
        persona = split.persona
    elif split.persona is not None and split.persona != persona:
        raise ConfigError(f"environment.persona is {persona} but split {split.name!r} is persona={split.persona}")

    jobs = build_jobs(
        EvaluationPlan(
            split=split.name,
            task_ids=split.task_ids,
            seed=config.experiment.seed,
            sample_size=config.tasks.sample_size,
            repeats=config.tasks.repeats,
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
    return PreparedExperiment(
        config=config,
        split=split,
        persona=persona,
        jobs=jobs,
        prompts=prompts,
        skills=skills,
        model_settings=_model_settings(config),
        environment_settings=_environment_settings(config, persona),
        final_test=final_test,
    )


@dataclass
class ServiceCheck:
    ready: bool
    reason: str | None
    """``model_unreachable``, ``model_not_listed``, ``environment_unreachable``, ``environment_not_ready``,
    ``environment_version_mismatch``, ``environment_no_free_slot``."""
    detail: str
    slots: SlotUsage | None = None
    warnings: list[str] = field(default_factory=list)


async def probe_model(model: OpenAICompatibleChatModel, settings: OpenAICompatibleSettings) -> ServiceCheck | None:
    """One probe of the model server's ``/models``: ``None`` when it lists ``settings.model``."""
    try:
        ids = await model.list_models()
    except Exception as exc:
        return ServiceCheck(False, "model_unreachable", f"{redact_uri(settings.base_url)}/models: {exc}")
    if settings.model not in ids:
        return ServiceCheck(False, "model_not_listed", f"{settings.model!r} is not among the served models {ids}")
    return None


async def probe_environment(
    environment: ShopSimulatorEnvironment,
    *,
    concurrency: int,
    processes: int,
    configured_leases: int | None,
    require_free_slot: bool,
) -> ServiceCheck:
    """One probe of ShopSimulator's ``/healthz``: ready, version, slots (``concurrency``: the
    sessions one process holds at once; ``configured_leases``: ``environment.max_leases``)."""
    base_url = environment.settings.base_url
    try:
        health = await environment.healthz()
    except EnvironmentVersionError as exc:
        return ServiceCheck(False, "environment_version_mismatch", str(exc))
    except Exception as exc:
        return ServiceCheck(False, "environment_unreachable", f"{redact_uri(base_url)}/healthz: {exc}")
    if health.get("ready") is not True:
        return ServiceCheck(False, "environment_not_ready", f"/healthz says {health}")
    usage = SlotUsage.from_healthz(health)
    limit = lease_budget(
        concurrency=concurrency, processes=processes, environment_slots=usage.environment_slots, configured=configured_leases
    )
    sizing = usage.sizing_warning(concurrency=concurrency, processes=processes, lease_limit=limit)
    warnings = [sizing] if sizing else []
    if require_free_slot and usage.free_slots == 0:
        return ServiceCheck(
            False,
            "environment_no_free_slot",
            f"ShopSimulator has 0/{usage.environment_slots} slots free: another run holds them, or leaked them "
            f"(`shopsimrl env slots --url {redact_uri(base_url)}`)",
            usage,
            warnings,
        )
    return ServiceCheck(True, None, f"environment is ready ({usage.describe()})", usage, warnings)


async def _check_once(prepared: PreparedExperiment, *, processes: int, require_free_slot: bool) -> ServiceCheck:
    model = prepared.model()
    environment = prepared.environment()
    try:
        not_ready = await probe_model(model, prepared.model_settings)
        if not_ready is not None:
            return not_ready
        check = await probe_environment(
            environment,
            concurrency=prepared.config.experiment.concurrency,
            processes=processes,
            configured_leases=prepared.config.environment.max_leases,
            require_free_slot=require_free_slot,
        )
        if check.ready:
            check.detail = f"model and environment are ready ({check.slots.describe() if check.slots else ''})"
        return check
    finally:
        await model.aclose()
        await environment.aclose()


async def poll_until_ready(probe: Callable[[], Awaitable[ServiceCheck]], *, timeout: float, interval: float) -> ServiceCheck:
    """Run ``probe`` until it says ready or ``timeout`` seconds have passed: the last check."""
    deadline = time.monotonic() + timeout
    while True:
        check = await probe()
        if check.ready or time.monotonic() + interval > deadline:
            return check
        await asyncio.sleep(interval)


async def check_services(
    prepared: PreparedExperiment,
    *,
    timeout: float = 0.0,
    interval: float = 5.0,
    processes: int = 1,
    require_free_slot: bool = True,
) -> ServiceCheck:
    """Probe once, or keep probing until ready or ``timeout`` seconds have passed.

    ``processes``: shard workers that will run at once (for the slot sizing warning);
    ``require_free_slot``: a shop with no free slot is not ready."""
    return await poll_until_ready(
        lambda: _check_once(prepared, processes=processes, require_free_slot=require_free_slot),
        timeout=timeout,
        interval=interval,
    )

"""``shopsimrl skills build SKILLS.yaml``: a frozen train run's traces → success and failure
cards → clusters per channel → the Gate A draft, each stage resumable by its input fingerprint.

SKILLS.yaml carries the earlier implementation's keys (``trace2skill_config``); paths are relative
to the file::

    experiment:
      traces: runs/train-qwen35-4b                # traces.jsonl, a run dir, a sharded run, s3://… (required)
      output_dir: skills/qwen35-4b-initial        # required
      expected_trajectories: 400                  # exactly this many, else refused
      seed: 20260831
      concurrency: 4
    environment: {base_url: http://127.0.0.1:5700, timeout: 30, persona: true}
    analysis: {max_cards_per_trajectory: 2, max_failure_steps: 12}
    compilation: {batch_size: 40, validation_dimension_cap: 16, active_skill_budget: 10}
    proposal_checkpoint: qwen35-4b-initial
    analyst_model: {name: Qwen/Qwen3.5-27B, base_url: http://127.0.0.1:8001/v1, api_key_env: null}
    compiler_model: null                          # default: the analyst model
    tracking: {backends: [wandb], mode: offline}  # optional: the stage's figures to W&B / MLflow

Each failed trajectory gets the failure analyst: a live counterfactual session of its task on
the ShopSimulator at ``environment.base_url`` (:mod:`shopsimrl.research.skills.failure`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shopsimrl.config import ConfigError, TrackingSection, check_environment_url, read_yaml_mapping
from shopsimrl.environment import ShopSimulatorSettings
from shopsimrl.model import OpenAICompatibleSettings
from shopsimrl.research.judge.config import check_judge_url
from shopsimrl.research.skills.analyst import (
    CARDS_NAME,
    AnalystConfig,
    SkillInputError,
    run_success_analysis,
)
from shopsimrl.research.skills.cards import CLUSTERS_TOOL, FAILURE_TOOL, INITIAL_SKILL_TOOL, SUCCESS_TOOL
from shopsimrl.research.skills.compile import CompilerConfig, compile_skill
from shopsimrl.research.skills.consolidate import ConsolidatorConfig, read_cards, run_consolidation
from shopsimrl.research.skills.failure import FailureAnalysis, FailureConfig
from shopsimrl.research.skills.inputs import read_train_traces
from shopsimrl.schemas import sha256_hex

__all__ = [
    "ANALYST_BASE_URL_ENV",
    "ENVIRONMENT_BASE_URL_ENV",
    "BuildResult",
    "SkillsConfig",
    "analyst_config",
    "build_skills",
    "failure_config",
    "format_build",
    "load_skills_config",
]

ANALYST_BASE_URL_ENV = "SHOPSIMRL_ANALYST_BASE_URL"
"""Overrides ``analyst_model.base_url`` (and the compiler's when it defaults to the analyst): a
pod reaches the analyst server at an in-cluster address. The URL is no part of a fingerprint."""
ENVIRONMENT_BASE_URL_ENV = "SHOPSIMRL_ENV_BASE_URL"
"""Overrides ``environment.base_url``, the variable the runner's workers read: a pod reaches
ShopSimulator at an in-cluster address. The URL is no part of a fingerprint."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    name: str = Field(min_length=1)
    base_url: str = Field(min_length=1)
    api_key_env: str | None = "OPENAI_API_KEY"
    checkpoint_id: str | None = None
    temperature: float = Field(0.0, ge=0.0)
    max_tokens: int = Field(4096, ge=1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    timeout: float = Field(300.0, gt=0.0)
    max_retries: int = Field(5, ge=1)
    retry_backoff_seconds: float = Field(1.0, ge=0.0)
    trust_env: bool = True
    stream: bool = False
    send_seed: bool = True
    tool_choice: Literal["forced", "required", "auto"] = "forced"
    """``forced`` names the stage's function; ``required`` or ``auto`` for servers that refuse that."""
    assistant_content_empty_string: bool = False
    extra_body: dict[str, Any] = Field(default_factory=dict)

    @field_validator("temperature", "timeout", "retry_backoff_seconds")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    def settings(self, tool_name: str) -> OpenAICompatibleSettings:
        choice: Any = {"type": "function", "function": {"name": tool_name}} if self.tool_choice == "forced" else self.tool_choice
        return OpenAICompatibleSettings(
            model=self.name,
            base_url=self.base_url,
            api_key_env=self.api_key_env,
            checkpoint_id=self.checkpoint_id,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            top_p=self.top_p,
            timeout=self.timeout,
            max_retries=self.max_retries,
            retry_backoff_seconds=self.retry_backoff_seconds,
            trust_env=self.trust_env,
            stream=self.stream,
            send_seed=self.send_seed,
            tool_choice=choice,
            extra_body=dict(self.extra_body),
            assistant_content_empty_string=self.assistant_content_empty_string,
        )


class ExperimentSection(_Strict):
    traces: str = Field(min_length=1)
    output_dir: str = Field(min_length=1)
    expected_trajectories: int = Field(400, ge=1)
    seed: int = 20260831
    concurrency: int = Field(4, ge=1, le=256)


class EnvironmentSection(_Strict):
    """The ShopSimulator the failure analyst's live sessions run on."""

    base_url: str = Field("http://127.0.0.1:5700", min_length=1)
    timeout: float = Field(30.0, gt=0.0)
    persona: bool = True

    @field_validator("base_url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value

    @field_validator("timeout")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    def settings(self) -> ShopSimulatorSettings:
        return ShopSimulatorSettings(base_url=self.base_url, timeout=self.timeout, persona=self.persona)


class AnalysisSection(_Strict):
    max_failure_steps: int = Field(12, ge=2)
    """Model calls of a failure analysis (live actions: one less); 2 leaves room for one action."""
    max_cards_per_trajectory: int = Field(2, ge=1, le=8)
    live_tool_choice: Literal["required", "auto"] = "required"
    """The failure analyst's calls that offer the page's tools too, when the analyst's
    ``tool_choice`` is ``forced``: ``auto`` for servers that refuse ``required`` (llama.cpp)."""


class CompilationSection(_Strict):
    batch_size: int = Field(40, ge=1)
    validation_dimension_cap: int = Field(16, ge=1, le=16)
    active_skill_budget: int = Field(10, ge=1, le=16)


class SkillsConfig(_Strict):
    experiment: ExperimentSection
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    analysis: AnalysisSection = Field(default_factory=AnalysisSection)
    compilation: CompilationSection = Field(default_factory=CompilationSection)
    proposal_checkpoint: str = Field("initial", min_length=1)
    analyst_model: ModelSection
    compiler_model: ModelSection | None = None
    tracking: TrackingSection | None = None
    """The stage's figures to experiment trackers (``--track`` adds one); never fails the stage."""
    source_path: Path | None = None

    def location(self, value: str) -> str:
        """A path resolved like :meth:`resolve`, or a URI (``s3://…``) as it is."""
        return value if "://" in value else str(self.resolve(value))

    def resolve(self, value: str) -> Path:
        path = Path(value).expanduser()
        if path.is_absolute() or self.source_path is None:
            return path
        return (self.source_path.parent / path).resolve()


StageConfig = TypeVar("StageConfig", bound=BaseModel)


def read_stage_config(model: type[StageConfig], path: Path, what: str) -> StageConfig:
    """A stage's YAML (SKILLS.yaml, ONLINE.yaml) as ``model``, its ``source_path`` set for
    relative paths; :class:`SkillInputError` naming the file and every bad key otherwise."""
    try:
        data = read_yaml_mapping(path, what)
    except ValueError as exc:
        raise SkillInputError(str(exc)) from None
    if "source_path" in data:
        raise SkillInputError(f"invalid {what} {path}: source_path: unknown key")
    try:
        return model.model_validate({**data, "source_path": path.resolve()})
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "<root>"
            kind = {"extra_forbidden": "unknown key", "missing": "required key is missing"}.get(error["type"], error["msg"])
            problems.append(f"{where}: {kind}")
        raise SkillInputError(f"invalid {what} {path}: " + "; ".join(problems)) from None


def load_skills_config(path: str | Path) -> SkillsConfig:
    """SKILLS.yaml; :class:`SkillInputError` naming the file and every bad key otherwise."""
    path = Path(path)
    config = read_stage_config(SkillsConfig, path, "skills config")
    override = os.environ.get(ANALYST_BASE_URL_ENV)
    if override:
        try:
            check_judge_url(override)
        except ValueError as exc:
            raise SkillInputError(f"{ANALYST_BASE_URL_ENV} (overrides analyst_model.base_url of {path}): {exc}") from None
        config = config.model_copy(update={"analyst_model": config.analyst_model.model_copy(update={"base_url": override})})
    shop = os.environ.get(ENVIRONMENT_BASE_URL_ENV)
    if shop:
        try:
            check_environment_url(shop)
        except ConfigError as exc:
            raise SkillInputError(f"{ENVIRONMENT_BASE_URL_ENV} (overrides environment.base_url of {path}): {exc}") from None
        config = config.model_copy(update={"environment": config.environment.model_copy(update={"base_url": shop})})
    if config.compilation.active_skill_budget > config.compilation.validation_dimension_cap:
        raise SkillInputError(
            f"invalid skills config {path}: compilation.active_skill_budget ({config.compilation.active_skill_budget}) "
            f"must not exceed compilation.validation_dimension_cap ({config.compilation.validation_dimension_cap})"
        )
    return config


def analyst_config(config: SkillsConfig) -> AnalystConfig:
    """The success analyst's settings of SKILLS.yaml (the local stage and the sharded workers)."""
    return AnalystConfig(
        model=config.analyst_model.settings(SUCCESS_TOOL),
        seed=config.experiment.seed,
        concurrency=config.experiment.concurrency,
        max_cards=config.analysis.max_cards_per_trajectory,
    )


def failure_config(config: SkillsConfig) -> FailureConfig:
    """The failure analyst's settings of SKILLS.yaml (the local stage and the sharded workers)."""
    return FailureConfig(
        model=config.analyst_model.settings(FAILURE_TOOL),
        environment=config.environment.settings(),
        seed=config.experiment.seed,
        max_failure_steps=config.analysis.max_failure_steps,
        live_tool_choice=config.analysis.live_tool_choice,
    )


@dataclass(frozen=True)
class BuildResult:
    output_dir: Path
    analysis: dict[str, Any]
    consolidation: dict[str, Any]
    manifest: dict[str, Any]

    @property
    def complete(self) -> bool:
        return self.manifest.get("status") == "complete" and self.analysis["episodes"]["missing"] == 0


def build_skills(config: SkillsConfig) -> BuildResult:
    """Analyse, consolidate and compile (module docstring); every stage skips what its input
    fingerprint says is done."""
    e = config.experiment
    output_dir = config.resolve(e.output_dir)
    traces = read_train_traces(config.location(e.traces), expected=e.expected_trajectories)
    analyst = config.analyst_model
    compiler = config.compiler_model or analyst
    analysis = run_success_analysis(traces, output_dir, analyst_config(config), FailureAnalysis(failure_config(config)))
    cards = read_cards(output_dir / CARDS_NAME)
    consolidation = run_consolidation(
        cards,
        output_dir,
        ConsolidatorConfig(
            model=compiler.settings(CLUSTERS_TOOL),
            seed=e.seed,
            concurrency=e.concurrency,
            batch_size=config.compilation.batch_size,
        ),
        {trace.episode_id: trace for trace in traces},
    )
    if consolidation["status"] != "complete":
        manifest = {"status": "not_compiled", "reason": "the consolidation is incomplete", "consolidation": consolidation}
        return BuildResult(output_dir, analysis, consolidation, manifest)
    manifest = compile_skill(
        output_dir,
        CompilerConfig(
            model=compiler.settings(INITIAL_SKILL_TOOL),
            seed=e.seed,
            validation_dimension_cap=config.compilation.validation_dimension_cap,
            active_skill_budget=config.compilation.active_skill_budget,
            proposal_checkpoint=config.proposal_checkpoint,
        ),
        inputs={
            traces.input_name: traces.digest,
            CARDS_NAME: sha256_hex((output_dir / CARDS_NAME).read_bytes()),
        },
    )
    return BuildResult(output_dir, analysis, consolidation, manifest)


def format_build(result: BuildResult) -> str:
    """What ``skills build`` prints: one line per stage and where the draft is."""
    a, c, m = result.analysis, result.consolidation, result.manifest
    episodes = a["episodes"]
    failures = episodes.get("failure", episodes.get("failure_pending", 0))
    statuses = (a.get("failure_cards") or {}).get("status") or {}
    proposals = sum(count for status, count in statuses.items() if status != "NO_PROPOSAL")
    lines = [
        f"analysis       {episodes['analysed']} of {episodes['total']} trajectories analysed ({episodes['analysed_now']} now: "
        f"{episodes['success']} successful, {failures} failed), {a['cards']['eligible']} eligible cards of "
        f"{a['cards']['total']}; {proposals} failure proposals, {statuses.get('NO_PROPOSAL', 0)} NO_PROPOSAL",
        f"consolidation  {c['status']}: {c['clusters']} clusters from {c['cards']} cards in {c['batches']['total']} batches",
    ]
    if m.get("status") == "complete":
        lines.append(f"compilation    complete: {m['chunks']} chunks ({', '.join(m['chunk_ids'])})")
        lines.append(f"draft          {result.output_dir / 'initial_skill_draft.json'} (gate_a.draft_path)")
    else:
        lines.append(f"compilation    {m.get('status')}: {m.get('reason') or (m.get('error') or {}).get('message')}")
    return "\n".join(lines)

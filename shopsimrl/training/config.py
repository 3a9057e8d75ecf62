"""The training rollout config (YAML), validated like an experiment config.

The sections the episode engine shares with evaluation are the experiment config's own
(:mod:`shopsimrl.config`: ``environment``, ``runtime``, ``prompt``, ``skills``), so a key means
the same in both files; ``run``, ``tasks``, ``model``, ``filter`` and ``triage`` are the training ones.
Unknown keys are rejected with their path, numbers and flags are checked strictly, relative
paths resolve against the YAML file's directory::

    run:
      name: round-001            # default: the file's stem; the run directory is output_dir/name
      output_dir: ../runs/training   # or s3://bucket/prefix: the run as immutable parts there
      seed: 20260901             # episode seeds: sha256(seed:task:index), index = slime's sample index
      concurrency: 16            # episodes in flight in the rollout process
      flush_rollouts: 16         # object store: rollouts per part (a local run writes each at once)
      flush_seconds: 5.0         # object store: the longest a finished rollout waits for its part
    tasks:
      split_file: splits/persona_splits.v1.json
      split: train               # a held-out test split is refused
    environment: {base_url: http://127.0.0.1:5700, persona: true}
    runtime: {max_steps: 30}
    prompt: {system_prompt_file: prompts/system.txt}
    skills: {path: null}
    model:
      name: qwen3.5-4b           # identity the traces record
      base_url: null             # null: slime's router, http://{sglang_router_ip}:{sglang_router_port}
      tokenizer: hf              # hf: the model's tokenizer and chat template; testbed: the testbed's
      tokenizer_path: null       # hf: its directory; null inside slime: slime's --hf-checkpoint
    filter:
      max_consecutive_unscored_groups: 8
    triage:
      full_skill_retry: true     # one diagnostic rollout with every chunk per all-wrong group
    curriculum:                  # optional; skills.path must then be null
      state: curricula/round-001.json   # the state `shopsimrl training build-curriculum` wrote
      skillbank: gates/selected_skillbank.json  # the bank it was built from (digest checked)

With a curriculum every group's skills are drawn from it by slime's ``group_index``
(:mod:`shopsimrl.training.curriculum`); the worker and ``training check`` refuse a state whose
recorded bank digest or chunks differ from ``curriculum.skillbank``.

Where slime finds it (:func:`config_path`): slime's ``--custom-config-path`` YAML sets each of its
keys on slime's ``args``, so a key ``shopsim_training_config: /path/training.yaml`` there names
it; without one, the ``SHOPSIMRL_TRAINING_CONFIG`` environment variable does. Both set and
different is an error (which one was meant is not guessable).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shopsimrl.config import (
    ConfigError,
    EnvironmentSection,
    PromptSection,
    RuntimeSection,
    SkillsSection,
    _check_service_url,
    format_validation_error,
    read_yaml_mapping,
    resolve_path,
    safe_name,
)
from shopsimrl.schemas import redact_uri
from shopsimrl.tasks import TaskSplit, load_task_split

__all__ = [
    "CONFIG_ARG",
    "CONFIG_ENV",
    "ENV_URL_VARIABLE",
    "TOKEN_URL_VARIABLE",
    "CurriculumSection",
    "TrainingConfig",
    "config_path",
    "load_training_config",
    "training_split",
]

CONFIG_ARG = "shopsim_training_config"
"""The slime ``args`` attribute (a key of slime's ``--custom-config-path`` YAML) naming the config."""
CONFIG_ENV = "SHOPSIMRL_TRAINING_CONFIG"
"""The environment variable naming the config when slime's args do not."""
ENV_URL_VARIABLE = "SHOPSIMRL_ENV_BASE_URL"
"""Overrides ``environment.base_url`` (as for evaluation): where the pod's shop is, not what it plays."""
TOKEN_URL_VARIABLE = "SHOPSIMRL_TOKEN_ENDPOINT_URL"
"""Overrides ``model.base_url``, the token endpoint (slime's router when neither is set)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class RunSection(_Strict):
    name: str | None = None
    output_dir: str = "../runs/training"
    """A local directory, or an object store location (``s3://bucket/prefix``, any URL with ``://``)."""
    seed: int = Field(default=20260901, ge=0)
    concurrency: int = Field(default=16, ge=1)
    flush_rollouts: int = Field(default=16, ge=1)
    """Object store only: rollouts written together as one part (a local run writes each at once)."""
    flush_seconds: float = Field(default=5.0, gt=0)
    """Object store only: the longest a finished rollout waits for its part to be written."""


class TrainingTasksSection(_Strict):
    split_file: str
    split: str = "train"


class TrainingModelSection(_Strict):
    name: str = "policy"
    checkpoint_id: str | None = None
    base_url: str | None = None
    tokenizer: Literal["hf", "testbed"] = "testbed"
    """``hf``: the model's Hugging Face tokenizer and chat template (``tokenizer_path``, else slime's
    ``--hf-checkpoint``); ``testbed``: the testbed's byte-level tokenizer and Qwen-style template."""
    tokenizer_path: str | None = None
    """``hf`` only: the tokenizer's directory (relative to this file); null inside slime: slime's
    ``args.hf_checkpoint``, the directory slime loads its own tokenizer from."""
    tokenizer_trust_remote_code: bool = False
    """``hf`` only: let transformers run code shipped in the tokenizer's directory."""
    timeout: float = Field(default=180.0, gt=0)
    max_retries: int = Field(default=5, ge=1)
    retry_backoff_seconds: float = Field(default=1.0, ge=0)
    send_seed: bool = True

    @model_validator(mode="after")
    def _tokenizer_options(self) -> TrainingModelSection:
        if self.tokenizer != "hf":
            for key in ("tokenizer_path", "tokenizer_trust_remote_code"):
                if getattr(self, key):
                    raise ValueError(f"{key} applies to tokenizer 'hf' only, and tokenizer is {self.tokenizer!r}")
        return self

    @field_validator("base_url")
    @classmethod
    def _service_url(cls, value: str | None) -> str | None:
        # The evaluation's URL rule: no credentials, no query or fragment (paths are appended).
        if value is None:
            return None
        return _check_service_url(value, credentials_hint="the token endpoint takes no credentials", allow_query=False)


class FilterSection(_Strict):
    max_consecutive_unscored_groups: int = Field(default=8, ge=1)
    """Groups dropped in a row for an unscored sample before the filter stops the training."""
    reward_spread: float = Field(default=1e-6, ge=0)
    """A group whose rewards (one per rollout) spread no more than this is dropped."""


class TriageSection(_Strict):
    full_skill_retry: bool = True
    """Play one diagnostic rollout with every curriculum chunk when all samples of a group failed
    (:mod:`shopsimrl.training.triage`); false: classify such groups ``all_wrong_retry_disabled``."""


class CurriculumSection(_Strict):
    state: str
    """The curriculum state file (``shopsimrl training build-curriculum``)."""
    skillbank: str
    """The gate-selected bank the state was built from: its digest and records must match the state's."""


class TrainingConfig(_Strict):
    run: RunSection = Field(default_factory=RunSection)
    tasks: TrainingTasksSection
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    prompt: PromptSection = Field(default_factory=PromptSection)
    skills: SkillsSection = Field(default_factory=SkillsSection)
    model: TrainingModelSection = Field(default_factory=TrainingModelSection)
    filter: FilterSection = Field(default_factory=FilterSection)
    triage: TriageSection = Field(default_factory=TriageSection)
    curriculum: CurriculumSection | None = None
    source_path: Path | None = Field(default=None, exclude=True)

    @field_validator("source_path", mode="before")
    @classmethod
    def _path(cls, value: Any) -> Any:
        return Path(value) if isinstance(value, str) else value

    @property
    def base_dir(self) -> Path:
        return self.source_path.parent if self.source_path else Path.cwd()

    def resolve(self, value: str) -> Path:
        return resolve_path(self.base_dir, value)

    @property
    def name(self) -> str:
        raw = self.run.name or (self.source_path.stem if self.source_path else "training")
        name = safe_name(raw)
        if not name:
            raise ConfigError(f"run.name {raw!r} has no usable characters")
        return name

    @property
    def on_object_store(self) -> bool:
        """``run.output_dir`` is a URL (``s3://…``): the run is written as immutable parts there."""
        return "://" in self.run.output_dir

    @property
    def run_location(self) -> str:
        """Where the run is: ``output_dir/name``, a local path or an object store URL."""
        if self.on_object_store:
            return f"{self.run.output_dir.rstrip('/')}/{self.name}"
        return str(self.run_dir)

    @property
    def run_dir(self) -> Path:
        """The local run directory; a ConfigError when ``run.output_dir`` is an object store."""
        if self.on_object_store:
            raise ConfigError(f"run.output_dir {redact_uri(self.run.output_dir)} is an object store location, not a directory")
        return self.resolve(self.run.output_dir) / self.name


def load_training_config(path: str | Path, environ: dict[str, str] | None = None) -> TrainingConfig:
    """Read and validate; :class:`ConfigError` naming the file and the key (or line) otherwise.
    ``$SHOPSIMRL_ENV_BASE_URL`` and ``$SHOPSIMRL_TOKEN_ENDPOINT_URL`` (``environ``, default the
    process's) replace the service addresses, checked like the file's."""
    path = Path(path)
    data = read_yaml_mapping(path, "training config")
    try:
        config = TrainingConfig.model_validate({**data, "source_path": path.resolve()})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(f"training config {path}", exc)) from None
    try:
        _ = config.name
    except ConfigError as exc:
        raise ConfigError(f"training config {path}: {exc}") from None
    if config.prompt.system_prompt is not None and config.prompt.system_prompt_file is not None:
        raise ConfigError(f"training config {path}: prompt.system_prompt and prompt.system_prompt_file are mutually exclusive")
    if config.curriculum is not None and config.skills.path is not None:
        raise ConfigError(
            f"training config {path}: curriculum and skills.path are mutually exclusive (the curriculum chooses each "
            "group's skills); set skills.path: null"
        )
    return _with_environment(config, dict(os.environ) if environ is None else environ)


def _with_environment(config: TrainingConfig, environ: dict[str, str]) -> TrainingConfig:
    data = config.model_dump(exclude={"source_path"})
    for variable, section in ((ENV_URL_VARIABLE, "environment"), (TOKEN_URL_VARIABLE, "model")):
        if environ.get(variable):
            data[section]["base_url"] = environ[variable]
    if data == config.model_dump(exclude={"source_path"}):
        return config
    try:
        return TrainingConfig.model_validate({**data, "source_path": config.source_path})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(f"${ENV_URL_VARIABLE} / ${TOKEN_URL_VARIABLE}", exc)) from None


def training_split(config: TrainingConfig) -> tuple[TaskSplit, bool]:
    """The split the config trains on and the persona mode of its episodes; :class:`ConfigError`
    (or the split's own error) naming what is wrong: a held-out test split, a persona setting that
    contradicts the split's, or none known."""
    split = load_task_split(config.resolve(config.tasks.split_file), config.tasks.split)
    if split.is_test:
        raise ConfigError(f"tasks.split {split.name!r} is (or overlaps) the held-out test split; training never runs it")
    persona = config.environment.persona if config.environment.persona is not None else split.persona
    if persona is None:
        raise ConfigError(f"environment.persona is null and split {split.name!r} does not say; set environment.persona")
    if split.persona is not None and persona != split.persona:
        raise ConfigError(f"environment.persona is {persona} but split {split.name!r} is persona={split.persona}")
    return split, persona


def config_path(args: Any, environ: dict[str, str] | None = None) -> Path:
    """The config slime's process should use (module docstring): ``args.shopsim_training_config``,
    else ``$SHOPSIMRL_TRAINING_CONFIG``; :class:`ConfigError` naming both when neither is set."""
    environ = dict(os.environ) if environ is None else environ
    from_args = getattr(args, CONFIG_ARG, None)
    from_env = environ.get(CONFIG_ENV) or None
    if from_args is not None and not isinstance(from_args, str | os.PathLike):
        raise ConfigError(f"slime argument {CONFIG_ARG} must be a path, got {from_args!r}")
    if from_args and from_env and Path(from_args).resolve() != Path(from_env).resolve():
        raise ConfigError(
            f"slime argument {CONFIG_ARG} ({from_args}) and ${CONFIG_ENV} ({from_env}) name different configs; set one"
        )
    chosen = from_args or from_env
    if not chosen:
        raise ConfigError(
            f"no training config: set {CONFIG_ARG}: PATH in slime's --custom-config-path YAML, or ${CONFIG_ENV}=PATH"
        )
    return Path(chosen)

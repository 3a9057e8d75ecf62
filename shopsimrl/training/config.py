"""The training rollout config (YAML), validated like an experiment config.

The sections the episode engine shares with evaluation are the experiment config's own
(:mod:`shopsimrl.config`: ``environment``, ``runtime``, ``prompt``, ``skills``), so a key means
the same in both files; ``run``, ``tasks``, ``model`` and ``filter`` are the training ones.
Unknown keys are rejected with their path, numbers and flags are checked strictly, relative
paths resolve against the YAML file's directory::

    run:
      name: round-001            # default: the file's stem; the run directory is output_dir/name
      output_dir: ../runs/training
      seed: 20260901             # episode seeds: sha256(seed:task:index), index = slime's sample index
      concurrency: 16            # episodes in flight in the rollout process
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

Where slime finds it (:func:`config_path`): slime's ``--custom-config-path`` YAML sets each of its
keys on slime's ``args``, so a key ``shopsim_training_config: /path/training.yaml`` there names
it; without one, the ``SHOPSIMRL_TRAINING_CONFIG`` environment variable does. Both set and
different is an error (which one was meant is not guessable).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shopsimrl.config import (
    ConfigError,
    EnvironmentSection,
    PromptSection,
    RuntimeSection,
    SkillsSection,
    _check_service_url,
    format_validation_error,
    safe_name,
)

__all__ = [
    "CONFIG_ARG",
    "CONFIG_ENV",
    "TrainingConfig",
    "config_path",
    "load_training_config",
]

CONFIG_ARG = "shopsim_training_config"
"""The slime ``args`` attribute (a key of slime's ``--custom-config-path`` YAML) naming the config."""
CONFIG_ENV = "SHOPSIMRL_TRAINING_CONFIG"
"""The environment variable naming the config when slime's args do not."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class RunSection(_Strict):
    name: str | None = None
    output_dir: str = "../runs/training"
    seed: int = Field(default=20260901, ge=0)
    concurrency: int = Field(default=16, ge=1)


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


class TrainingConfig(_Strict):
    run: RunSection = Field(default_factory=RunSection)
    tasks: TrainingTasksSection
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    prompt: PromptSection = Field(default_factory=PromptSection)
    skills: SkillsSection = Field(default_factory=SkillsSection)
    model: TrainingModelSection = Field(default_factory=TrainingModelSection)
    filter: FilterSection = Field(default_factory=FilterSection)
    source_path: Path | None = Field(default=None, exclude=True)

    @field_validator("source_path", mode="before")
    @classmethod
    def _path(cls, value: Any) -> Any:
        return Path(value) if isinstance(value, str) else value

    @property
    def base_dir(self) -> Path:
        return self.source_path.parent if self.source_path else Path.cwd()

    def resolve(self, value: str) -> Path:
        path = Path(os.path.expanduser(value))
        return path if path.is_absolute() else (self.base_dir / path).resolve()

    @property
    def name(self) -> str:
        raw = self.run.name or (self.source_path.stem if self.source_path else "training")
        name = safe_name(raw)
        if not name:
            raise ConfigError(f"run.name {raw!r} has no usable characters")
        return name

    @property
    def run_dir(self) -> Path:
        return self.resolve(self.run.output_dir) / self.name


def load_training_config(path: str | Path) -> TrainingConfig:
    """Read and validate; :class:`ConfigError` naming the file and the key (or line) otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read training config {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"training config {path} is not UTF-8: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"training config {path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"training config {path} must be a YAML mapping at the top level")
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
    return config


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

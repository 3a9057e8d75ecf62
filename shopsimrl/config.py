"""Experiment configuration (YAML) and worker settings (environment variables).

The YAML key tree is the earlier implementation's (``experiment``, ``tasks``, ``environment``,
``runtime``, ``prompt``, ``skills``, ``model``), so existing configs load unchanged, with two
deliberate differences: unknown keys are rejected with their path (a typo such as
``max_token`` no longer passes silently), and ``model.trust_env`` defaults to false so proxy
variables never reroute traffic to a local model server.

Every number and flag is checked strictly: ``seed: true`` or ``max_tokens: "5"`` are errors, not
1 and 5, and NaN or infinity are refused wherever a number is expected. Service URLs must be
plain ``http(s)://host[:port][/path]`` without ``user:password@`` (credentials in a URL would be
sent as Basic auth and could be echoed into traces; the model key comes from
``model.api_key_env``).

Relative paths are resolved against the YAML file's directory. Deployment-specific values come
from the environment through :class:`WorkerSettings` (``SHOPSIMRL_*``), so a pod needs no edits
of the YAML: in-cluster Service URLs, concurrency, flush cadence, the shard index.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from dotenv.parser import parse_stream as parse_dotenv
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "ConfigError",
    "CostSection",
    "EnvironmentSection",
    "ExperimentConfig",
    "ExperimentSection",
    "ModelSection",
    "PromptSection",
    "RuntimeSection",
    "SkillsSection",
    "TasksSection",
    "WorkerSettings",
    "check_environment_url",
    "describe_settings_error",
    "load_experiment_config",
    "safe_name",
]


class ConfigError(ValueError):
    """The experiment config is unreadable or invalid; the message names the file and key path."""


def safe_name(value: str) -> str:
    """Runs of characters outside ``[A-Za-z0-9._-]`` become ``-``; ``-`` and ``.`` stripped at the ends."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", value).strip("-.")


_MODEL_CREDENTIALS_HINT = "put the API key in the environment variable named by model.api_key_env"
_ENVIRONMENT_CREDENTIALS_HINT = "ShopSimulator takes no credentials"


def _check_service_url(url: str, *, credentials_hint: str, allow_query: bool) -> str:
    """``url`` unchanged if it can be a service base URL; otherwise a pydantic error saying why.

    The error text never repeats the URL, so a password in it cannot reach the terminal or a log.
    """

    def refuse(reason: str) -> PydanticCustomError:
        return PydanticCustomError("service_url", reason)

    if not url.strip():
        raise refuse("must not be blank")
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        raise refuse("is not a valid URL (malformed host or port)") from None
    if parts.scheme not in ("http", "https"):
        raise refuse("must start with http:// or https://")
    if "@" in parts.netloc:
        raise refuse(f"must not contain user:password@ credentials; {credentials_hint}")
    if not parts.hostname or not port_ok:
        raise refuse("needs a host (and a port from 1 to 65535 if one is given)")
    if parts.fragment or url.endswith("#"):
        raise refuse("must not have a #fragment")
    if parts.query and not allow_query:
        raise refuse("must not have a ?query (request paths are appended to this URL)")
    return url


def check_environment_url(url: str) -> None:
    """ConfigError when ``url`` cannot be a ShopSimulator base URL (for URLs given as flags)."""
    try:
        _check_service_url(url, credentials_hint=_ENVIRONMENT_CREDENTIALS_HINT, allow_query=False)
    except PydanticCustomError as exc:
        raise ConfigError(exc.message()) from None


def _mask_userinfo(text: str) -> str:
    """``scheme://user:pass@host`` → ``scheme://host`` inside any text (for echoing bad input)."""
    return re.sub(r"://[^\s'\"]*@", "://", text)


class _Strict(BaseModel):
    # strict: no bool for an int, no string for a number; NaN and infinity are never a setting.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ExperimentSection(_Strict):
    name: str | None = None
    """Run name; default: the YAML file's stem. Sanitised to ``[A-Za-z0-9._-]``."""
    output_dir: str = "../runs"
    """Local run root; the run directory is ``output_dir/name``."""
    dotenv: str | None = None
    """Optional ``KEY=VALUE`` file; never overrides variables already set in the process."""
    seed: int = Field(default=20260828, ge=0)
    """Non-negative: ``random.Random`` would sample the same tasks for ``-s`` as for ``s``."""
    concurrency: int = Field(default=1, ge=1)
    """Episodes in flight per process (execution only, not fingerprinted)."""
    resume: bool = True
    """true: skip completed episodes. false: refuse to reuse an existing run directory."""


class TasksSection(_Strict):
    split_file: str
    split: str
    sample_size: int | None = Field(default=None, ge=1)
    repeats: int = Field(default=1, ge=1)


class EnvironmentSection(_Strict):
    base_url: str = "http://127.0.0.1:5700"
    timeout: float = Field(default=30.0, gt=0)
    persona: bool | None = None
    interaction_mode: Literal["single_turn", "multi_turn"] = "single_turn"
    reset_timeout: float | None = Field(default=900.0, gt=0)
    """How long an episode waits for a free environment slot (the server queues resets)."""
    max_leases: int | None = Field(default=None, ge=1)
    """Leases one process holds or requests at once (execution only, not fingerprinted).
    Null: an equal share of the shop's slots (``/healthz``) per process, at most the concurrency."""
    cleanup_grace_seconds: float = Field(default=30.0, gt=0, le=3600)
    """At exit, how long pending resets and lease releases may take before they are abandoned."""
    max_retries: int = Field(default=4, ge=1)
    """Total attempts per call where a retry is safe (1 = never retry), like ``model.max_retries``."""
    expected_environment_version: str | None = None
    expected_observation_version: str | None = None

    @field_validator("base_url")
    @classmethod
    def _service_url(cls, value: str) -> str:
        return _check_service_url(value, credentials_hint=_ENVIRONMENT_CREDENTIALS_HINT, allow_query=False)


class RuntimeSection(_Strict):
    max_steps: int = Field(default=30, ge=1)
    max_episode_retries: int = Field(default=2, ge=0)
    """Extra attempts per episode for infrastructure failures, counted per invocation."""


class PromptSection(_Strict):
    system_prompt: str | None = None
    system_prompt_file: str | None = None


class SkillsSection(_Strict):
    path: str | None = None
    max_skills: int | None = Field(default=None, ge=1)


class ModelSection(_Strict):
    id: str | None = None
    name: str
    base_url: str
    checkpoint_id: str | None = None
    api_key_env: str | None = "OPENAI_API_KEY"
    temperature: float = Field(default=0.0, ge=0)
    max_tokens: int = Field(default=512, ge=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    timeout: float = Field(default=180.0, gt=0)
    max_retries: int = Field(default=5, ge=1)
    """Total attempts per model call (the earlier implementation's meaning of the key)."""
    retry_backoff_seconds: float = Field(default=1.0, ge=0)
    trust_env: bool = False
    stream: bool = False
    send_seed: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    extra_body: dict[str, Any] = Field(default_factory=dict)
    assistant_content_empty_string: bool = False
    """Send assistant turns without text as ``content: ""`` (llama.cpp rejects ``null``)."""
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    """Model calls one process has in flight; default: the episode concurrency."""

    @field_validator("name")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value

    @field_validator("base_url")
    @classmethod
    def _service_url(cls, value: str) -> str:
        # A query (e.g. a gateway's api-version) is kept: the adapter puts paths before it.
        return _check_service_url(value, credentials_hint=_MODEL_CREDENTIALS_HINT, allow_query=True)

    @field_validator("checkpoint_id", "api_key_env")
    @classmethod
    def _blank_is_error(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be a non-blank string or null")
        return value


# --------------------------------------------------------------------------- cost (prices)


class CostSection(_Strict):
    """Prices that turn a run's tokens and accelerator time into money (``cost:``). Execution
    only: recorded in the manifest's ``execution.cost`` when the run is created and never
    fingerprinted (prices change no episode). Every summary of the run prices from that record
    (docs/runtime_eval.md §5, "Cost")."""

    currency: str = Field(default="USD", min_length=1, max_length=16)
    """A label printed beside amounts; nothing is converted."""
    prompt_per_million: float | None = Field(default=None, ge=0)
    """Price per million prompt tokens, as the model server reports ``usage.prompt_tokens``."""
    completion_per_million: float | None = Field(default=None, ge=0)
    """Price per million completion tokens (``usage.completion_tokens``; reasoning tokens are
    part of them on OpenAI-compatible servers)."""
    accelerators: float | None = Field(default=None, gt=0)
    """Accelerators (GPUs) the model server runs on; a fraction for a slice (MIG). Set: the
    summary reports accelerator hours."""
    server_share: float = Field(default=1.0, gt=0, le=1)
    """This run's share of the model server (e.g. 1/3 when three runs use it at once)."""
    accelerator_per_hour: float | None = Field(default=None, ge=0)
    """Price of one accelerator for one hour (needs ``accelerators``)."""

    @model_validator(mode="after")
    def _accelerators_for_a_price(self) -> CostSection:
        if self.accelerator_per_hour is not None and self.accelerators is None:
            raise ValueError("cost.accelerator_per_hour needs cost.accelerators (how many the model server runs on)")
        return self


class ExperimentConfig(_Strict):
    experiment: ExperimentSection = Field(default_factory=ExperimentSection)
    tasks: TasksSection
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    prompt: PromptSection = Field(default_factory=PromptSection)
    skills: SkillsSection = Field(default_factory=SkillsSection)
    model: ModelSection
    cost: CostSection | None = None
    """Prices for the summary's money and accelerator hours; null: tokens and times only."""
    source_path: Path | None = Field(default=None, exclude=True)
    """The YAML file this config came from (never persisted)."""

    @property
    def base_dir(self) -> Path:
        return self.source_path.parent if self.source_path else Path.cwd()

    def resolve(self, value: str) -> Path:
        path = Path(os.path.expanduser(value))
        return path if path.is_absolute() else (self.base_dir / path).resolve()

    @property
    def name(self) -> str:
        raw = self.experiment.name or (self.source_path.stem if self.source_path else "experiment")
        name = safe_name(raw)
        if not name:
            raise ConfigError(f"experiment.name {raw!r} has no usable characters")
        return name

    @property
    def model_id(self) -> str:
        return safe_name(self.model.id or self.model.name) or "model"

    @property
    def run_dir(self) -> Path:
        return self.resolve(self.experiment.output_dir) / self.name

    def with_overrides(self, settings: WorkerSettings) -> ExperimentConfig:
        """Apply deployment overrides from the environment (URLs, concurrency)."""
        update: dict[str, Any] = {}
        if settings.model_base_url:
            update["model"] = self.model.model_copy(update={"base_url": settings.model_base_url})
        if settings.env_base_url:
            update["environment"] = self.environment.model_copy(update={"base_url": settings.env_base_url})
        if settings.concurrency:
            update["experiment"] = self.experiment.model_copy(update={"concurrency": settings.concurrency})
        return self.model_copy(update=update) if update else self


class WorkerSettings(BaseSettings):
    """Execution settings from flags or ``SHOPSIMRL_*`` environment variables (never fingerprinted)."""

    model_config = SettingsConfigDict(env_prefix="SHOPSIMRL_", extra="ignore", populate_by_name=True, allow_inf_nan=False)

    run: str | None = None
    config: str | None = None
    shards: int | None = Field(default=None, ge=1)
    shard_index: int | None = Field(
        default=None, ge=0, validation_alias=AliasChoices("SHOPSIMRL_SHARD_INDEX", "JOB_COMPLETION_INDEX", "shard_index")
    )
    model_base_url: str | None = None
    env_base_url: str | None = None
    concurrency: int | None = Field(default=None, ge=1)
    parallelism: int | None = Field(default=None, ge=1)
    """Shard workers running at once (the Job's parallelism); default: the shard count. Each
    gets an equal share of the shop's slots."""
    processes: int | None = Field(default=None, ge=1, le=256)
    """Processes (event loops) one shard worker runs its episodes in; default 1. Each takes its
    own share of the jobs, parts and leases; the worker commits the shard once all are done."""
    flush_episodes: int = Field(default=10, ge=1)
    flush_seconds: float = Field(default=10.0, gt=0)
    heartbeat_seconds: float = Field(default=30.0, gt=0)
    """How often a shard worker rewrites its progress object while it runs (``status`` shows a
    shard whose heartbeat is older than 3 intervals as possibly stopped)."""

    @field_validator("model_base_url")
    @classmethod
    def _model_url(cls, value: str | None) -> str | None:
        return None if value is None else _check_service_url(value, credentials_hint=_MODEL_CREDENTIALS_HINT, allow_query=True)

    @field_validator("env_base_url")
    @classmethod
    def _environment_url(cls, value: str | None) -> str | None:
        return (
            None
            if value is None
            else _check_service_url(value, credentials_hint=_ENVIRONMENT_CREDENTIALS_HINT, allow_query=False)
        )


def describe_settings_error(exc: ValidationError) -> str:
    """One line naming each bad ``SHOPSIMRL_*`` variable (values with credentials masked)."""
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        if field == "SHOPSIMRL_SHARD_INDEX":
            name = "SHOPSIMRL_SHARD_INDEX or JOB_COMPLETION_INDEX"
        else:
            name = field if field.isupper() else f"SHOPSIMRL_{field.upper()}"
        problems.append(f"{name}: {error['msg']} (got {_mask_userinfo(repr(error.get('input')))})")
    return "invalid environment variable " + "; ".join(problems)


def format_validation_error(what: str, exc: ValidationError) -> str:
    """``invalid <what>: …``: one line for one problem; otherwise a header and one line per
    problem, each naming its key. ``what`` names the file (``config path/to.yaml``)."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "<root>"
        if error["type"] == "extra_forbidden":
            problems.append(f"{where}: unknown key")
        elif error["type"] == "missing":
            problems.append(f"{where}: required key is missing")
        else:
            problems.append(f"{where}: {error['msg']} (got {_mask_userinfo(repr(error.get('input')))})")
    if len(problems) == 1:
        return f"invalid {what}: {problems[0]}"
    return "\n".join([f"invalid {what}:", *(f"  {problem}" for problem in problems)])


def _load_dotenv(path: Path) -> None:
    """``experiment.dotenv`` into the process environment; a variable already set is never overridden.

    The file is read by python-dotenv's parser, the one pydantic-settings reads ``.env`` files
    with (``export``, quotes and escapes, comments; no ``${VAR}`` expansion). pydantic-settings'
    own dotenv source is not used: it maps a file onto a settings model's fields, drops empty
    values and reports no line for a statement it cannot parse. Every variable is checked before
    any is set, so a malformed file changes nothing.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"experiment.dotenv file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read experiment.dotenv file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"experiment.dotenv file {path} is not UTF-8: {exc}") from None
    values: dict[str, str] = {}
    for binding in parse_dotenv(io.StringIO(text)):
        if binding.key is None and not binding.error:
            continue  # a blank or comment line
        if (
            binding.error
            or binding.value is None
            or binding.key is None
            or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", binding.key)
        ):
            # The parser counts blank lines before a statement as its own; the statement is not
            # echoed (a .env file holds secrets).
            statement = binding.original.string
            line = binding.original.line + statement[: len(statement) - len(statement.lstrip())].count("\n")
            raise ConfigError(f"{path}:{line}: expected KEY=VALUE (KEY a variable name: letters, digits, _)")
        values[binding.key] = binding.value
    for key, value in values.items():
        os.environ.setdefault(key, value)


def load_experiment_config(path: str | Path, *, load_dotenv: bool = True) -> ExperimentConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not UTF-8: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config {path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a YAML mapping at the top level")
    if "models" in data:
        raise ConfigError(f"config {path}: 'models' is not supported; use one model mapping under 'model' per run")
    try:
        config = ExperimentConfig.model_validate({**data, "source_path": path.resolve()})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(f"config {path}", exc)) from None
    try:
        _ = config.name  # derived on use; derive it now so a bad name stops the load, not a run
    except ConfigError as exc:
        raise ConfigError(f"config {path}: {exc}") from None
    if config.prompt.system_prompt is not None and config.prompt.system_prompt_file is not None:
        raise ConfigError(f"config {path}: prompt.system_prompt and prompt.system_prompt_file are mutually exclusive")
    if load_dotenv and config.experiment.dotenv:
        _load_dotenv(config.resolve(config.experiment.dotenv))
    return config

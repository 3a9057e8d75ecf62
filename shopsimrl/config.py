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

Command-line overrides (``--set KEY=VALUE`` and its short forms, :class:`ConfigOverride`) are
merged into the YAML's mapping before it is validated, so a value set there is checked, planned
and fingerprinted exactly as the same edit of the file would be. Precedence, lowest first: the
YAML, the ``SHOPSIMRL_*`` variables (:meth:`ExperimentConfig.with_overrides`), the command line.
Paths given on the command line are relative to the current directory, not to the YAML's.
"""

from __future__ import annotations

import copy
import io
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

import yaml
from dotenv.parser import parse_stream as parse_dotenv
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from shopsimrl.schemas import redact_uri

__all__ = [
    "PATH_KEYS",
    "TRACKERS",
    "ConfigError",
    "ConfigOverride",
    "CostSection",
    "EnvironmentSection",
    "ExperimentConfig",
    "ExperimentSection",
    "ModelSection",
    "PromptSection",
    "RuntimeSection",
    "SkillsSection",
    "TasksSection",
    "TrackerName",
    "TrackingSection",
    "WorkerSettings",
    "check_environment_url",
    "describe_settings_error",
    "load_experiment_config",
    "parse_set_option",
    "safe_name",
]


class ConfigError(ValueError):
    """The experiment config is unreadable or invalid; the message names the file and key path."""


@dataclass(frozen=True)
class ConfigOverride:
    """One value that replaces the YAML's: ``key`` dotted (``model.checkpoint_id``), ``value`` as
    YAML would have read it, ``source`` the flag or variable it came from (``--set``,
    ``--checkpoint``, ``SHOPSIMRL_MODEL_BASE_URL``)."""

    key: str
    value: Any
    source: str

    @property
    def from_command_line(self) -> bool:
        return self.source.startswith("-")

    @property
    def origin(self) -> str:
        """Where the value came from, for a message (never the value: it may be a URL)."""
        return f"--set {self.key}" if self.source == "--set" else self.source

    def as_set_option(self) -> str:
        """``KEY=VALUE`` that ``--set`` reads back to this key and value (for a worker process)."""
        text = yaml.safe_dump(self.value, default_flow_style=True, width=math.inf, allow_unicode=True)
        return f"{self.key}={text.removesuffix(chr(10) + '...' + chr(10)).rstrip(chr(10))}"

    def as_record(self) -> dict[str, Any]:
        """For ``plan`` and the manifest's ``execution.overrides``: URLs redacted."""
        value = redact_uri(self.value) if isinstance(self.value, str) and "://" in self.value else self.value
        return {"key": self.key, "value": value, "from": self.source}


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


def _shown_input(value: Any) -> str:
    """A bad value as an error message repeats it: a URL without credentials (``user:password@``,
    a ``?token=`` query value), so a secret typed in the wrong place is not echoed."""
    if isinstance(value, str) and "://" in value:
        value = redact_uri(value)
    return _mask_userinfo(repr(value))


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
    max_model_seconds: float | None = Field(default=None, gt=0)
    """The episode's time limit: once its model replies together took this long (the sum of the
    answering attempts' ``latency_ms``), no further call is made and the episode is terminated
    (``time_limit``). Null: no limit. Semantic (fingerprinted); see docs/runtime_eval.md §2."""
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
    adaptive_concurrency: bool = True
    """Start below that ceiling and adapt to the server's load (shopsimrl.inflight); false: keep
    every permitted call in flight. Scheduling only: not part of the plan."""

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


# --------------------------------------------------------------------------- tracking (experiment trackers)

TrackerName = Literal["wandb", "mlflow"]
TRACKERS: tuple[TrackerName, ...] = get_args(TrackerName)
_TRACKER_NAME = re.compile(r"[^/\\#?%:]{1,128}")
"""A W&B project or entity name (neither may hold ``/ \\ # ? % :``), also an MLflow experiment's."""


class TrackingSection(_Strict):
    """Experiment trackers a run's results go to (``tracking:``; ``--track`` adds one): W&B and
    MLflow, through the research tools' ``tracking`` extra (``shopsimrl[tracking]``). Execution
    only: never fingerprinted, never in the manifest. A tracker that fails (not installed,
    network, authentication) is reported and never changes the run's exit code. Credentials come
    from the trackers' own environment variables (``WANDB_API_KEY``, ``MLFLOW_TRACKING_TOKEN``,
    ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``), never from this block (docs/tracking.md)."""

    backends: list[TrackerName] = Field(default_factory=list)
    """Which trackers: ``wandb``, ``mlflow``; empty: none unless ``--track`` names one."""
    project: str | None = None
    """The W&B project and the MLflow experiment; null: ``WANDB_PROJECT`` / ``MLFLOW_EXPERIMENT_NAME``, else ``shopsimrl``."""
    entity: str | None = None
    """The W&B entity (team or user); null: ``WANDB_ENTITY`` or the account's default. MLflow has none."""
    mode: Literal["online", "offline"] | None = None
    """W&B: ``offline`` writes the run under ``dir`` only (``wandb sync`` uploads it later); null: ``WANDB_MODE``, else online."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the tracker's run (W&B tags; MLflow tags with the value ``true``), up to 64 characters each."""
    tracking_uri: str | None = None
    """The MLflow tracking server (``http(s)://host:port``) or store (``file:``, ``sqlite:``, ``databricks``); null:
    ``MLFLOW_TRACKING_URI``, else MLflow's default. No ``user:password@``: MLflow reads credentials from its variables."""
    dir: str | None = None
    """W&B's local directory (an offline run lands in ``dir/wandb/``); relative to the YAML; null: ``WANDB_DIR``, else the current directory."""
    name: str | None = None
    """The tracker run's name; null: the experiment name."""
    episodes: bool = True
    """Log the table of episodes (one row per episode)."""
    report: bool = True
    """Log the HTML report (``shopsimrl report``) as an artifact."""
    max_episode_rows: int = Field(default=10_000, ge=0)
    """Rows of the episode table at most (W&B's table limit); a larger run logs its first rows and says so."""
    timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    """How long a tracker may wait on its server per call (W&B's init timeout, MLflow's request timeout; two retries)."""

    @field_validator("backends")
    @classmethod
    def _once_each(cls, value: list[TrackerName]) -> list[TrackerName]:
        return list(dict.fromkeys(value))

    @field_validator("project", "entity")
    @classmethod
    def _tracker_name(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or not _TRACKER_NAME.fullmatch(value)):
            raise ValueError("must be 1 to 128 characters without / \\ # ? % :")
        return value

    @field_validator("name")
    @classmethod
    def _run_name(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be a non-blank string or null")
        return value

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: list[str]) -> list[str]:
        for tag in value:
            if not tag.strip() or len(tag) > 64:
                raise ValueError(f"tag {tag!r}: a tag has 1 to 64 characters")
        return list(dict.fromkeys(value))

    @field_validator("tracking_uri")
    @classmethod
    def _tracking_uri(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip():
            raise ValueError("must be a non-blank URI or null")
        try:
            parts = urlsplit(value)
        except ValueError:
            raise PydanticCustomError("tracking_uri", "is not a valid URI") from None
        if "@" in parts.netloc:
            # The message never repeats the URI: a password in it must not reach the terminal.
            raise PydanticCustomError(
                "tracking_uri",
                "must not contain user:password@ credentials; MLflow reads them from MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)",
            )
        if redact_uri(value) != value:
            raise PydanticCustomError(
                "tracking_uri", "must not carry a credential in its ?query; MLflow reads it from MLFLOW_TRACKING_TOKEN"
            )
        return value

    def with_trackers(self, names: Sequence[str]) -> TrackingSection:
        """These settings with ``names`` (``--track``) added to the trackers."""
        return self.model_copy(update={"backends": list(dict.fromkeys([*self.backends, *names]))})


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
    tracking: TrackingSection | None = None
    """Experiment trackers the results go to (W&B, MLflow); null: none unless ``--track`` names one."""
    source_path: Path | None = Field(default=None, exclude=True)
    """The YAML file this config came from (never persisted)."""
    _overrides: tuple[ConfigOverride, ...] = PrivateAttr(default=())
    _run_dir: Path | None = PrivateAttr(default=None)

    @property
    def overrides(self) -> tuple[ConfigOverride, ...]:
        """The values that replaced the YAML's: from the command line, then from ``SHOPSIMRL_*``."""
        return self._overrides

    def at_run_dir(self, run_dir: Path) -> ExperimentConfig:
        """This config writing to ``run_dir`` instead of ``output_dir/name`` (``run --run DIR``;
        not part of the plan, like ``output_dir``)."""
        copy = self.model_copy()
        copy._run_dir = run_dir
        return copy

    @property
    def base_dir(self) -> Path:
        return self.source_path.parent if self.source_path else Path.cwd()

    def resolve(self, value: str) -> Path:
        return resolve_path(self.base_dir, value)

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
        return self._run_dir if self._run_dir is not None else self.resolve(self.experiment.output_dir) / self.name

    def with_overrides(self, settings: WorkerSettings) -> ExperimentConfig:
        """Apply deployment overrides from the environment (URLs, concurrency), except where the
        command line set the same key: it is the more specific of the two."""
        on_command_line = {override.key for override in self._overrides if override.from_command_line}
        update: dict[str, Any] = {}
        applied: list[ConfigOverride] = []
        for key, variable, value in (
            ("model.base_url", "SHOPSIMRL_MODEL_BASE_URL", settings.model_base_url),
            ("environment.base_url", "SHOPSIMRL_ENV_BASE_URL", settings.env_base_url),
            ("experiment.concurrency", "SHOPSIMRL_CONCURRENCY", settings.concurrency),
        ):
            if not value or key in on_command_line:
                continue
            section, field = key.split(".")
            current = update.get(section, getattr(self, section))
            update[section] = current.model_copy(update={field: value})
            applied.append(ConfigOverride(key, value, variable))
        if not update:
            return self
        copy = self.model_copy(update=update)
        copy._overrides = (*self._overrides, *applied)
        return copy


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
        problems.append(f"{name}: {error['msg']} (got {_shown_input(error.get('input'))})")
    return "invalid environment variable " + "; ".join(problems)


def format_validation_error(what: str, exc: ValidationError, origins: Mapping[str, str] | None = None) -> str:
    """``invalid <what>: …``: one line for one problem; otherwise a header and one line per
    problem, each naming its key. ``what`` names the file (``config path/to.yaml``); ``origins``
    maps a dotted key set on the command line to its flag, named beside a problem at or under it."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "<root>"
        if error["type"] == "extra_forbidden":
            problem = f"{where}: unknown key"
        elif error["type"] == "missing":
            problem = f"{where}: required key is missing"
        else:
            problem = f"{where}: {error['msg']} (got {_shown_input(error.get('input'))})"
        origin = _origin_of(where, origins or {})
        if origin is not None:
            problem += f" [from {origin}]"
            if error["type"] == "string_type" and origin.startswith("--set") and not isinstance(error.get("input"), (dict, list)):
                # YAML reads 1000, 2024-01-01 or true as no string; quoting says it is one.
                problem += f"; to give it as text, quote it: --set '{where}=\"{error.get('input')}\"'"
        problems.append(problem)
    if len(problems) == 1:
        return f"invalid {what}: {problems[0]}"
    return "\n".join([f"invalid {what}:", *(f"  {problem}" for problem in problems)])


def _origin_of(where: str, origins: Mapping[str, str]) -> str | None:
    """The flag of the command-line override at ``where`` or around it (a section set whole, a key inside it)."""
    for key, origin in origins.items():
        if where == key or where.startswith(key + ".") or key.startswith(where + "."):
            return origin
    return None


# --------------------------------------------------------------------------- command-line overrides

_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
PATH_KEYS = frozenset(
    {"experiment.output_dir", "experiment.dotenv", "tasks.split_file", "prompt.system_prompt_file", "skills.path", "tracking.dir"}
)
"""Keys that hold paths: a relative one from the command line is relative to the current directory."""
_SECRET_SEGMENT = re.compile(
    r"(^|_)(api_?key|apikey|key|secret|password|passwd|credentials?|authorization|bearer|token|access_token|auth_token)($|_)"
)
"""A key that is no typed setting and whose name says it holds a secret (``extra_body.api_key``)."""


def parse_set_option(text: str) -> ConfigOverride:
    """``KEY=VALUE`` of ``--set``: the value read as YAML reads a scalar or a flow collection
    (``0.7``, ``true``, ``null``, ``[1, 2]``, ``{a: 1}``), so it validates as the file would."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.fullmatch(key):
        raise ConfigError(
            f"--set {text.partition('=')[0]!r}: expected KEY=VALUE with KEY a dotted config key (model.checkpoint_id=…)"
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: the value is not YAML: {getattr(exc, 'problem', None) or exc}") from None
    return ConfigOverride(key, value, "--set")


def _field_model(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (``X`` or ``X | None``), None for a free-form value."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, _Strict):
            return candidate
    return None


def _is_setting(key: str) -> bool:
    """``key`` names a declared setting of the config (never a secret: none holds one)."""
    model: type[BaseModel] | None = ExperimentConfig
    for segment in key.split("."):
        if model is None:
            return False  # inside a free-form mapping (extra_body, tool_choice)
        field = model.model_fields.get(segment)
        if field is None or field.exclude:
            return False
        model = _field_model(field.annotation)
    return True


def _secret_keys(key: str, value: Any) -> list[str]:
    """Dotted keys of ``key=value`` (a mapping value's keys included) that would carry a secret."""
    found = []
    if not _is_setting(key) and _SECRET_SEGMENT.search(key.rsplit(".", 1)[-1].lower().replace("-", "_")):
        found.append(key)
    if isinstance(value, dict):
        for inner, item in value.items():
            found += _secret_keys(f"{key}.{inner}", item)
    return found


def _check_overrides(overrides: Sequence[ConfigOverride]) -> None:
    seen: dict[str, ConfigOverride] = {}
    for override in overrides:
        secret = _secret_keys(override.key, override.value)
        if secret:
            what = "" if secret[0] == override.key else f" ({secret[0]})"
            raise ConfigError(
                f"{override.origin}{what}: refused: a secret must not go on the command line (shell history, the "
                "process list) nor into the run's manifest; put an API key in the environment variable named by "
                "model.api_key_env (OPENAI_API_KEY unless the config names another)"
            )
        for key, earlier in seen.items():
            if key == override.key or key.startswith(override.key + ".") or override.key.startswith(key + "."):
                raise ConfigError(
                    f"{min(key, override.key, key=len)} is set twice on the command line "
                    f"({earlier.origin}, {override.origin}); give each key once"
                )
        seen[override.key] = override


def _apply_overrides(data: dict[str, Any], overrides: Sequence[ConfigOverride], where: str) -> dict[str, Any]:
    """The YAML mapping with each override put at its dotted key (sections created as needed)."""
    merged = copy.deepcopy(data)
    for override in overrides:
        *sections, last = override.key.split(".")
        if override.key.split(".")[0] == "source_path":  # the loader's own field, no YAML key
            raise ConfigError(f"{override.origin}: unknown key")
        node = merged
        for depth, segment in enumerate(sections):
            child = node.setdefault(segment, {})
            if not isinstance(child, dict):
                above = ".".join(sections[: depth + 1])
                raise ConfigError(f"{override.origin}: {above} is not a mapping in {where} (it is {child!r})")
            node = child
        value = override.value
        if override.key in PATH_KEYS and isinstance(value, str) and value.strip():
            value = os.path.abspath(os.path.expanduser(value))
        node[last] = value
    return merged


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


def resolve_path(base_dir: Path, value: str) -> Path:
    """A path from a config file: ``~`` expanded, relative to the file's directory (``base_dir``)."""
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else (base_dir / path).resolve()


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """The YAML mapping at the top of ``path``; :class:`ConfigError` naming ``what``, the file and
    the line otherwise (unreadable, not UTF-8, not YAML, not a mapping)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{what} {path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a YAML mapping at the top level")
    return data


def load_experiment_config(
    path: str | Path, *, load_dotenv: bool = True, overrides: Sequence[ConfigOverride] = ()
) -> ExperimentConfig:
    """The config at ``path`` with ``overrides`` (from the command line) merged in before it is validated."""
    path = Path(path)
    data = read_yaml_mapping(path, "config")
    _check_overrides(overrides)
    data = _apply_overrides(data, overrides, f"config {path}")
    origins = {override.key: override.origin for override in overrides}
    if "models" in data:
        raise ConfigError(f"config {path}: 'models' is not supported; use one model mapping under 'model' per run")
    try:
        config = ExperimentConfig.model_validate({**data, "source_path": path.resolve()})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(f"config {path}", exc, origins)) from None
    config._overrides = tuple(overrides)
    try:
        _ = config.name  # derived on use; derive it now so a bad name stops the load, not a run
    except ConfigError as exc:
        origin = origins.get("experiment.name")
        raise ConfigError(f"config {path}: {exc}" + (f" [from {origin}]" if origin else "")) from None
    if config.prompt.system_prompt is not None and config.prompt.system_prompt_file is not None:
        named = [origins[key] for key in ("prompt.system_prompt", "prompt.system_prompt_file") if key in origins]
        raise ConfigError(
            f"config {path}: prompt.system_prompt and prompt.system_prompt_file are mutually exclusive"
            + (f" [{', '.join(named)} on the command line]" if named else "")
        )
    if load_dotenv and config.experiment.dotenv:
        _load_dotenv(config.resolve(config.experiment.dotenv))
    return config

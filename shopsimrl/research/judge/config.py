"""``JUDGE.yaml`` and the rubric file it names.

A judge config says what to judge (a frozen run, a selection as ``export judge-input`` takes it),
with what (an OpenAI-compatible judge model; the API key only by the name of its environment
variable) and by which rubric, and where the verdicts go (an explicit output directory or URI,
never inside the run). Relative paths are resolved against the YAML file's directory. Errors
name the file and the key (exit 2).

The rubric is a versioned YAML file: ``rubric_version``, the judge's ``instructions`` and the
verdict's JSON Schema (``verdict_schema``). Its sha256 (of the file's bytes) goes into every
output record and the judge manifest, so a verdict always says which rubric made it. The schema
is checked by :func:`schema_errors`, a validator of the JSON Schema subset a verdict needs
(``type``, ``enum``, ``properties``, ``required``, ``additionalProperties: false``, ``items``,
``minimum``/``maximum``, ``minLength``/``maxLength``, ``minItems``/``maxItems``,
``uniqueItems``); a rubric using any other keyword is refused when loaded rather than half
enforced. jsonschema is not a runtime dependency of the project, and this subset is all a
verdict needs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shopsimrl.config import ConfigError, check_environment_url
from shopsimrl.research.export import SELECTIONS
from shopsimrl.research.redaction import INCLUDABLE
from shopsimrl.schemas import canonical_json, fingerprint, sha256_hex

__all__ = [
    "JUDGE_BASE_URL_ENV",
    "JudgeConfig",
    "JudgeConfigError",
    "Rubric",
    "load_judge_config",
    "load_rubric",
    "schema_errors",
]

JUDGE_BASE_URL_ENV = "SHOPSIMRL_JUDGE_BASE_URL"
"""Overrides ``model.base_url`` (a pod reaches the judge server at an in-cluster address; a demo
at a free port) without editing the YAML, like ``SHOPSIMRL_MODEL_BASE_URL`` for rollouts."""
TOOL_NAME = "submit_verdict"


class JudgeConfigError(ValueError):
    """A judge config or rubric that cannot be used; the message names the file and key (exit 2)."""


_JUDGE_CREDENTIALS_HINT = "the judge's API key goes in the environment variable named by model.api_key_env of the judge config"


def check_judge_url(url: str) -> None:
    """ValueError when ``url`` cannot be the judge model's base URL: plain
    ``http(s)://host[:port][/path]``, no ``user:password@`` (the message never repeats the URL)."""
    try:
        credentials = "@" in urlsplit(url).netloc
    except ValueError:
        credentials = False  # malformed: the check below says how
    if credentials:
        raise ValueError(f"must not contain user:password@ credentials; {_JUDGE_CREDENTIALS_HINT}")
    try:
        check_environment_url(url)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class JudgeModelSection(_Strict):
    model: str = Field(min_length=1)
    base_url: str
    api_key_env: str | None = None
    """Name of the variable holding the key; the key itself is never read from or written to a file."""
    checkpoint_id: str | None = None
    temperature: float = Field(0.0, ge=0.0)
    max_tokens: int = Field(1024, ge=1)
    timeout: float = Field(120.0, gt=0.0)
    max_retries: int = Field(5, ge=1)
    """Attempts per HTTP call (the adapter's retries of 429/5xx/timeouts), not repairs."""
    retry_backoff_seconds: float = Field(1.0, ge=0.0)
    tool_choice: Literal["forced", "required", "auto"] = "forced"
    """``forced``: ``{"type": "function", "function": {"name": "submit_verdict"}}``; ``required``
    or ``auto`` for servers that reject a named function (llama.cpp's chat handlers)."""
    assistant_content_empty_string: bool = False
    send_length_bounds: bool = True
    """Send the verdict schema's length bounds (maxLength, minItems, …) with the tool. ``false``
    for servers that compile the schema into a grammar and fail on large bounds (llama.cpp
    refuses ``maxLength: 2000`` and then crashes); the bounds are checked here either way, and an
    answer outside them gets a repair turn."""
    extra_body: dict[str, Any] = Field(default_factory=dict)

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        check_judge_url(value)
        return value

    @field_validator("temperature", "timeout", "retry_backoff_seconds")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class SelectionSection(_Strict):
    select: str = "completed"
    """As ``export judge-input --select``: ``success``, ``completed`` or ``all``."""
    include: list[str] = Field(default_factory=list)
    """As ``export judge-input --include``: ``reasoning``, ``persona``, ``goal``."""

    @field_validator("select")
    @classmethod
    def _select(cls, value: str) -> str:
        if value not in SELECTIONS:
            raise ValueError(f"must be one of {', '.join(SELECTIONS)}")
        return value

    @field_validator("include")
    @classmethod
    def _include(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if name not in INCLUDABLE]
        if unknown:
            raise ValueError(f"unknown name(s) {', '.join(unknown)}; choose from {', '.join(INCLUDABLE)}")
        return sorted(set(value))


class JudgeConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    source: str = Field(min_length=1)
    """The run to judge: a local run directory (relative to this file) or a URI."""
    rubric: str = Field(min_length=1)
    output: str | None = None
    """Where ``shopsimrl judge`` writes (a directory, relative to this file); required there, and
    never inside the run. Sharded judging takes ``--out URI`` instead."""
    model: JudgeModelSection
    selection: SelectionSection = Field(default_factory=SelectionSection)
    max_repairs: int = Field(2, ge=0, le=10)
    concurrency: int = Field(8, ge=1, le=1024)
    flush_every: int = Field(16, ge=1)
    """Sharded workers: verdicts per part object (a killed worker loses at most these)."""
    source_path: Path | None = None

    def resolve(self, value: str) -> str:
        """A path relative to the config file's directory; URIs unchanged."""
        if "://" in value or self.source_path is None:
            return value
        path = Path(value)
        return str(path if path.is_absolute() else (self.source_path.parent / path).resolve())

    @property
    def source_location(self) -> str:
        return self.resolve(self.source)

    @property
    def base_url(self) -> str:
        return os.environ.get(JUDGE_BASE_URL_ENV) or self.model.base_url

    def frozen(self) -> dict[str, Any]:
        """What fixes the verdicts, as frozen into a judge manifest or plan: the model's settings
        (base URL left out: where a server is reached does not change what it answers), the
        selection, the repairs. Never a key, only the name of its variable."""
        model = self.model.model_dump(mode="json")
        model.pop("base_url")
        if model["send_length_bounds"]:
            del model["send_length_bounds"]  # the default: frozen as before the setting existed
        return {
            "name": self.name,
            "model": model,
            "selection": self.selection.model_dump(mode="json"),
            "max_repairs": self.max_repairs,
        }


def _parse_yaml(data: bytes, what: str, shown: str) -> Any:
    """The YAML document in ``data``; one line naming the file and the problem otherwise: bytes
    that are not UTF-8 text (where), or text that is not YAML (line, column, what)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JudgeConfigError(
            f"{what} {shown} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); it must be a YAML file"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise JudgeConfigError(f"{what} {shown} is not valid YAML{where}: {problem}") from None


def _read_yaml(path: Path, what: str) -> Any:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise JudgeConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    return _parse_yaml(data, what, str(path))


def _problems(path: Path, exc: ValidationError, what: str) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "<root>"
        if error["type"] == "extra_forbidden":
            problems.append(f"{where}: unknown key")
        elif error["type"] == "missing":
            problems.append(f"{where}: required key is missing")
        else:
            problems.append(f"{where}: {error['msg']}")
    if len(problems) == 1:
        return f"invalid {what} {path}: {problems[0]}"
    return "\n".join([f"invalid {what} {path}:", *(f"  {problem}" for problem in problems)])


def load_judge_config(path: str | Path) -> JudgeConfig:
    path = Path(path)
    data = _read_yaml(path, "judge config")
    if not isinstance(data, dict):
        raise JudgeConfigError(f"judge config {path} must be a YAML mapping at the top level")
    if "source_path" in data:
        raise JudgeConfigError(f"invalid judge config {path}: source_path: unknown key")
    try:
        config = JudgeConfig.model_validate({**data, "source_path": path.resolve()}, strict=False)
    except ValidationError as exc:
        raise JudgeConfigError(_problems(path, exc, "judge config")) from None
    override = os.environ.get(JUDGE_BASE_URL_ENV)
    if override:
        try:
            check_judge_url(override)
        except ValueError as exc:
            raise JudgeConfigError(f"{JUDGE_BASE_URL_ENV} (overrides model.base_url of {path}): {exc}") from None
    return config


# --------------------------------------------------------------------------- the rubric

_SCHEMA_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "uniqueItems",
        "description",
        "title",
    }
)
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def _check_schema(schema: Any, where: str) -> None:
    """Refuse a schema this validator would not enforce in full."""
    if not isinstance(schema, dict):
        raise JudgeConfigError(f"{where}: a schema must be a mapping")
    unknown = sorted(set(schema) - _SCHEMA_KEYWORDS)
    if unknown:
        raise JudgeConfigError(f"{where}: unsupported JSON Schema keyword(s) {', '.join(unknown)}")
    kind = schema.get("type")
    if kind is not None and kind not in _TYPES:
        raise JudgeConfigError(f"{where}.type: {kind!r} is not one of {', '.join(_TYPES)}")
    if "additionalProperties" in schema and schema["additionalProperties"] is not False:
        raise JudgeConfigError(f"{where}.additionalProperties: only false is supported")
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        raise JudgeConfigError(f"{where}.enum: must be a non-empty list")
    for name, sub in (schema.get("properties") or {}).items():
        _check_schema(sub, f"{where}.properties.{name}")
    if "items" in schema:
        _check_schema(schema["items"], f"{where}.items")


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return kind == "number" or isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def schema_errors(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """Every way ``value`` breaks ``schema`` (the subset of the module docstring), ``$.path: why``."""
    kind = schema.get("type")
    if kind is not None and not _type_ok(value, kind):
        return [f"{where}: expected {kind}, got {type(value).__name__}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where}: {value} is below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where}: {value} is above the maximum {schema['maximum']}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{where}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{where}: longer than {schema['maxLength']} characters")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{where}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{where}: more than {schema['maxItems']} items")
        if schema.get("uniqueItems") and len({canonical_json(item) for item in value}) != len(value):
            errors.append(f"{where}: items are not unique")
        if "items" in schema:
            for index, item in enumerate(value):
                errors += schema_errors(item, schema["items"], f"{where}[{index}]")
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for name in schema.get("required") or []:
            if name not in value:
                errors.append(f"{where}: required property {name!r} is missing")
        for name, item in value.items():
            if name in properties:
                errors += schema_errors(item, properties[name], f"{where}.{name}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}: unexpected property {name!r}")
    return errors


_LENGTH_BOUNDS = frozenset({"maxLength", "minLength", "maxItems", "minItems"})


def _without_length_bounds(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {key: _without_length_bounds(value) for key, value in schema.items() if key not in _LENGTH_BOUNDS}
    if isinstance(schema, list):
        return [_without_length_bounds(value) for value in schema]
    return schema


@dataclass(frozen=True)
class Rubric:
    version: str
    instructions: str
    verdict_schema: dict[str, Any]
    sha256: str
    path: str

    def tool(self, *, length_bounds: bool = True) -> dict[str, Any]:
        """The one tool offered: the verdict as the function's arguments (without the schema's
        length bounds when ``length_bounds`` is false)."""
        schema = self.verdict_schema if length_bounds else _without_length_bounds(self.verdict_schema)
        return {
            "type": "function",
            "function": {
                "name": TOOL_NAME,
                "description": "Submit the verdict on the episode. Call it exactly once.",
                "parameters": schema,
            },
        }

    def to_dict(self) -> dict[str, Any]:
        return {"rubric_version": self.version, "rubric_sha256": self.sha256}


def rubric_from_bytes(data: bytes, shown: str) -> Rubric:
    """A rubric from a file's bytes (``shown`` names it in errors)."""
    document = _parse_yaml(data, "rubric", shown)
    if not isinstance(document, dict):
        raise JudgeConfigError(f"rubric {shown} must be a YAML mapping")
    unknown = sorted(set(document) - {"rubric_version", "instructions", "verdict_schema"})
    if unknown:
        raise JudgeConfigError(f"rubric {shown}: unknown key(s) {', '.join(unknown)}")
    for key in ("rubric_version", "instructions"):
        if not isinstance(document.get(key), str) or not document[key].strip():
            raise JudgeConfigError(f"rubric {shown}: {key} must be a non-empty string")
    schema = document.get("verdict_schema")
    _check_schema(schema, f"rubric {shown}: verdict_schema")
    assert isinstance(schema, dict)  # _check_schema refuses anything else
    if schema.get("type") != "object" or "verdict" not in (schema.get("properties") or {}):
        raise JudgeConfigError(f"rubric {shown}: verdict_schema must be an object with a 'verdict' property")
    verdicts = schema["properties"]["verdict"].get("enum") or []
    if "success" not in verdicts:
        raise JudgeConfigError(f"rubric {shown}: verdict_schema.properties.verdict.enum must include 'success'")
    return Rubric(document["rubric_version"], document["instructions"], schema, sha256_hex(data), shown)


def load_rubric(path: str | Path) -> Rubric:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise JudgeConfigError(f"cannot read rubric {path}: {exc.strerror or exc}") from None
    return rubric_from_bytes(data, str(path))


def judge_fingerprint(config: JudgeConfig, rubric: Rubric, source: dict[str, Any]) -> str:
    """What a judge output is bound to: the run, the rubric, the frozen judge settings."""
    return fingerprint({"source": source, "rubric": rubric.to_dict(), "config": config.frozen()})

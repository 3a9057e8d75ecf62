"""GATE.yaml: what a skill gate measures, on which bare run, with which chunks.

The keys are the earlier implementation's, so its gate configs load unchanged (unknown keys are
errors here, naming their path)::

    gate_a:                                   # Gate A: a cold-start draft of 1–16 chunks
      name: trace2skill-gate-a
      output_dir: ../runs/gate-a              # the gate directory
      experiment_config: val.yaml             # the bare run's experiment (skills.path: null)
      bare_run_dir: ../runs/val-bare          # that run: a local directory or a URI (s3://…)
      draft_path: draft/initial_skill_draft.json
      draft_skillbank_path: draft/initial_skillbank.json   # default: next to the draft
      mask_seed: 20260901
      mask_probability: 0.5                   # the only value allowed
      active_skill_budget: 2                  # default: the draft's
      failed_episodes: refuse                 # or drop (see docs/paired_validation.md)
      max_dropped_share: 0.02                 # with drop: the most pairs that may be dropped

    online_gate:                              # the online gate: a candidate pool
      name: trace2skill-online-gate
      output_dir: …
      experiment_config: …                    # needs model.checkpoint_id
      bare_run_dir: …
      candidate_pool_path: pool.json
      mask_seed: 20260901
      active_skill_budget: 10

Relative paths are resolved against the GATE.yaml's directory; ``bare_run_dir`` may be any run
location :func:`shopsimrl.storage.reading.open_run` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shopsimrl.config import format_validation_error, safe_name

__all__ = ["GateSpec", "GateSpecError", "load_gate_spec"]


class GateSpecError(ValueError):
    """GATE.yaml is unreadable or invalid (exit 2); the message names the file and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class _Common(_Strict):
    output_dir: str
    experiment_config: str
    bare_run_dir: str
    mask_seed: int = 20260901
    failed_episodes: Literal["refuse", "drop"] = "refuse"
    max_dropped_share: float = Field(default=0.02, ge=0.0, le=1.0)

    @field_validator("output_dir", "experiment_config", "bare_run_dir")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value


class _GateA(_Common):
    name: str = "trace2skill-gate-a"
    draft_path: str
    draft_skillbank_path: str | None = None
    mask_probability: float = 0.5
    active_skill_budget: int | None = Field(default=None, ge=1)

    @field_validator("mask_probability")
    @classmethod
    def _half(cls, value: float) -> float:
        if value != 0.5:
            raise ValueError("must be 0.5 (Gate A shows each chunk with probability one half)")
        return value


class _Online(_Common):
    name: str = "trace2skill-online-gate"
    candidate_pool_path: str
    active_skill_budget: int = Field(default=10, ge=1)


class _GateFile(_Strict):
    gate_a: _GateA | None = None
    online_gate: _Online | None = None


@dataclass(frozen=True)
class GateSpec:
    kind: Literal["gate_a", "online"]
    name: str
    source: Path
    """The GATE.yaml file."""
    gate_dir: Path
    experiment_config: Path
    bare_run: str
    """A local path (resolved) or a URI, as ``open_run`` takes it."""
    mask_seed: int
    active_skill_budget: int | None
    """None: Gate A takes the draft's budget."""
    draft_path: Path | None = None
    draft_skillbank_path: Path | None = None
    candidate_pool_path: Path | None = None
    raw: dict[str, Any] | None = None
    """The gate's section as written (recorded in the gate manifest)."""
    failed_episodes: Literal["refuse", "drop"] = "refuse"
    """refuse: a failed masked episode leaves the gate incomplete; drop: its pair is left out."""
    max_dropped_share: float = 0.02
    """With drop: the largest share of pairs that may be dropped before the gate is refused."""

    @property
    def manifest_name(self) -> str:
        return "gate_a_manifest.json" if self.kind == "gate_a" else "online_gate_manifest.json"


def _resolve(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path).resolve()


def _location(base: Path, value: str) -> str:
    return value if "://" in value else str(_resolve(base, value))


FAILED_EPISODE_POLICIES: Final = ("refuse", "drop")


def _overridden(source: Path, data: dict[str, Any], failed_episodes: str | None, max_dropped_share: float | None) -> None:
    """Apply the command line's --failed-episodes / --max-dropped-share to the section in place
    (the flags win over the file); validated by the same model as the file's keys."""
    if failed_episodes is None and max_dropped_share is None:
        return
    for key in ("gate_a", "online_gate"):
        section = data.get(key)
        if isinstance(section, dict):
            if failed_episodes is not None:
                if failed_episodes not in FAILED_EPISODE_POLICIES:
                    raise GateSpecError(
                        f"--failed-episodes must be refuse or drop, not {failed_episodes!r} (overrides {key}.failed_episodes of {source})"
                    )
                section["failed_episodes"] = failed_episodes
            if max_dropped_share is not None:
                if not (0.0 <= max_dropped_share <= 1.0):
                    raise GateSpecError(
                        f"--max-dropped-share must be between 0 and 1, not {max_dropped_share} "
                        f"(overrides {key}.max_dropped_share of {source})"
                    )
                section["max_dropped_share"] = float(max_dropped_share)


def load_gate_spec(path: str | Path, *, failed_episodes: str | None = None, max_dropped_share: float | None = None) -> GateSpec:
    source = Path(path)
    try:
        data = yaml.safe_load(source.read_text(encoding="utf-8"))
    except OSError as exc:
        raise GateSpecError(f"cannot read gate config {source}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise GateSpecError(f"gate config {source} is not UTF-8: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise GateSpecError(f"gate config {source} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise GateSpecError(f"gate config {source} must be a mapping with a 'gate_a' or an 'online_gate' section")
    _overridden(source, data, failed_episodes, max_dropped_share)
    try:
        parsed = _GateFile.model_validate(data)
    except ValidationError as exc:
        raise GateSpecError(format_validation_error(f"gate config {source}", exc)) from None
    if (parsed.gate_a is None) == (parsed.online_gate is None):
        raise GateSpecError(f"gate config {source} needs exactly one of the sections 'gate_a' and 'online_gate'")
    base = source.resolve().parent
    section: _GateA | _Online = parsed.gate_a or parsed.online_gate  # type: ignore[assignment]
    name = safe_name(section.name)
    if not name:
        raise GateSpecError(f"invalid gate config {source}: name {section.name!r} has no usable characters")
    common: dict[str, Any] = {
        "name": name,
        "source": source.resolve(),
        "gate_dir": _resolve(base, section.output_dir),
        "experiment_config": _resolve(base, section.experiment_config),
        "bare_run": _location(base, section.bare_run_dir),
        "mask_seed": section.mask_seed,
        "raw": section.model_dump(),
        "failed_episodes": section.failed_episodes,
        "max_dropped_share": section.max_dropped_share,
    }
    if isinstance(section, _GateA):
        draft = _resolve(base, section.draft_path)
        bank = (
            _resolve(base, section.draft_skillbank_path)
            if section.draft_skillbank_path
            else draft.with_name("initial_skillbank.json")
        )
        return GateSpec(
            kind="gate_a",
            active_skill_budget=section.active_skill_budget,
            draft_path=draft,
            draft_skillbank_path=bank,
            **common,
        )
    return GateSpec(
        kind="online",
        active_skill_budget=section.active_skill_budget,
        candidate_pool_path=_resolve(base, section.candidate_pool_path),
        **common,
    )

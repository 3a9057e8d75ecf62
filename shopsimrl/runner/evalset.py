"""Eval sets: several checkpoints or configs run as one set (``shopsimrl evalset SET.yaml``).

SET.yaml holds ``location`` (a local folder), an optional shared ``config`` and ``set``, optional
``concurrency`` and ``tracking``, and ``members``: each ``name`` with optional ``config``, ``set``,
``model``, ``checkpoint``, ``experiment``. Every member is one run under ``<location>/<name>/``
with its own frozen plan; its overrides are exactly those of ``shopsimrl run CONFIG --set ...``,
so its fingerprint is that run's.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shopsimrl.config import PATH_KEYS, ConfigError, ConfigOverride, ExperimentConfig, WorkerSettings, load_experiment_config

__all__ = ["EvalSet", "EvalSetError", "Member", "load_evalset", "member_state"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TOP = {"location", "config", "set", "concurrency", "tracking", "members"}
_MEMBER = {"name", "config", "set", "model", "checkpoint", "experiment"}
# The short forms, as `run` spells them (shopsimrl.cli.common.command_line_overrides).
_SHORT = {
    "model": ("model.name", "--model"),
    "checkpoint": ("model.checkpoint_id", "--checkpoint"),
    "experiment": ("experiment.name", "--experiment"),
}


class EvalSetError(ConfigError):
    """SET.yaml is unusable; the message names the file, the line and the field."""


@dataclass(frozen=True)
class Member:
    name: str
    config: Path
    overrides: tuple[ConfigOverride, ...]
    line: int


@dataclass(frozen=True)
class EvalSet:
    path: Path
    location: Path
    concurrency: int | None
    tracking: dict[str, Any] | None
    members: tuple[Member, ...] = field(default_factory=tuple)

    def run_dir(self, member: Member) -> Path:
        return self.location / member.name

    def member_config(self, member: Member, settings: WorkerSettings | None = None) -> ExperimentConfig:
        """The member's config with its overrides, then ``settings`` (``SHOPSIMRL_*``) where
        they leave a key alone, as ``run`` loads it; at the member's own run folder."""
        # A path in `set` is relative to the member's config file, as if written in it: the
        # same file the Helm route mounts next to that config resolves it the same way.
        base = member.config.parent
        overrides = [
            ConfigOverride(o.key, str(base / os.path.expanduser(o.value)), o.source)
            if o.key in PATH_KEYS
            and isinstance(o.value, str)
            and o.value.strip()
            and not Path(os.path.expanduser(o.value)).is_absolute()
            else o
            for o in member.overrides
        ]
        if self.concurrency is not None:  # not part of the plan: the fingerprint stays `run`'s
            overrides.append(ConfigOverride("experiment.concurrency", self.concurrency, "--concurrency"))
        try:
            config = load_experiment_config(member.config, overrides=overrides)
        except ConfigError as exc:
            raise EvalSetError(f"{self.path}:{member.line}: member {member.name!r}: {exc}") from None
        if settings is not None:
            config = config.with_overrides(settings)
        return config.at_run_dir(self.run_dir(member))


def _lines(node: yaml.Node) -> dict[str, int]:
    """1-based line of each key of a mapping node."""
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {key.value: key.start_mark.line + 1 for key, _ in node.value if isinstance(key, yaml.ScalarNode)}


def _sets(value: Any, where: str) -> list[ConfigOverride]:
    if value is None:
        return []
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise EvalSetError(f"{where}: 'set' must be a mapping of dotted config keys to values")
    return [ConfigOverride(key, item, "--set") for key, item in value.items()]


def load_evalset(path: Path, *, remote: bool = False) -> EvalSet:
    """SET.yaml read and checked; :class:`EvalSetError` naming ``file:line`` and the field.
    ``remote``: an object-storage location is accepted (for the Helm route, which runs nothing)."""
    try:
        text = path.read_text(encoding="utf-8")
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except OSError as exc:
        raise EvalSetError(f"cannot read eval set {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise EvalSetError(f"eval set {path} is not UTF-8: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise EvalSetError(f"{path}{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict) or root is None:
        raise EvalSetError(f"{path}:1: an eval set must be a YAML mapping")
    lines = _lines(root)

    def at(key: str) -> str:
        return f"{path}:{lines.get(key, 1)}: {key}"

    for key in data:
        if key not in _TOP:
            raise EvalSetError(f"{at(str(key))}: unknown field (expected one of {', '.join(sorted(_TOP))})")
    location = data.get("location")
    if not isinstance(location, str) or not location:
        raise EvalSetError(f"{at('location')}: a folder is required")
    if "://" in location and not location.startswith("file://") and not remote:
        raise EvalSetError(
            f"{at('location')}: {location.split('://')[0]}:// is not run by the set itself; "
            "render one Helm release per member with --helm-values instead (docs/research.md)"
        )
    base_dir = path.parent
    location_path = Path(location.removeprefix("file://"))
    if not location_path.is_absolute():
        location_path = base_dir / location_path
    concurrency = data.get("concurrency")
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1):
        raise EvalSetError(f"{at('concurrency')}: must be a whole number of slots >= 1")
    tracking = data.get("tracking")
    if tracking is not None and not isinstance(tracking, dict):
        raise EvalSetError(f"{at('tracking')}: must be a mapping (the config's tracking: block)")
    shared_config = data.get("config")
    if shared_config is not None and not isinstance(shared_config, str):
        raise EvalSetError(f"{at('config')}: must be the path of an experiment YAML")
    shared_sets = _sets(data.get("set"), at("set"))
    members_value = data.get("members")
    if not isinstance(members_value, list) or not members_value:
        raise EvalSetError(f"{at('members')}: a non-empty list of members is required")
    member_nodes = dict(root.value).get(next(k for k, _ in root.value if k.value == "members"))
    members: list[Member] = []
    seen: set[str] = set()
    for index, entry in enumerate(members_value):
        node = member_nodes.value[index] if isinstance(member_nodes, yaml.SequenceNode) else None
        line = node.start_mark.line + 1 if node is not None else lines.get("members", 1)
        mlines = _lines(node) if node is not None else {}
        where = f"{path}:{line}: members[{index}]"
        if not isinstance(entry, dict):
            raise EvalSetError(f"{where}: must be a mapping with at least a name")
        for key in entry:
            if key not in _MEMBER:
                raise EvalSetError(
                    f"{path}:{mlines.get(str(key), line)}: members[{index}].{key}: unknown field "
                    f"(expected one of {', '.join(sorted(_MEMBER))})"
                )
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
            raise EvalSetError(
                f"{path}:{mlines.get('name', line)}: members[{index}].name: {name!r} must be a folder-safe name "
                "(letters, digits, '.', '_', '-'; at most 64)"
            )
        if name in seen:
            raise EvalSetError(f"{path}:{mlines.get('name', line)}: members[{index}].name: {name!r} is used twice")
        seen.add(name)
        config = entry.get("config", shared_config)
        if not isinstance(config, str):
            raise EvalSetError(f"{where}.config: no config (give one here or a shared 'config' at the top)")
        overrides = [*shared_sets, *_sets(entry.get("set"), f"{path}:{mlines.get('set', line)}: members[{index}].set")]
        for short, (key, flag) in _SHORT.items():
            if short in entry:
                if not isinstance(entry[short], str | int | float) or isinstance(entry[short], bool):
                    raise EvalSetError(f"{path}:{mlines.get(short, line)}: members[{index}].{short}: must be text")
                overrides.append(ConfigOverride(key, str(entry[short]), flag))
        if "model" in entry and not any(override.key == "model.id" for override in overrides):
            overrides.append(ConfigOverride("model.id", None, "--model"))  # as `run --model` does
        config_path = Path(config)
        members.append(Member(name, config_path if config_path.is_absolute() else base_dir / config_path, tuple(overrides), line))
    return EvalSet(path, location_path, concurrency, tracking, tuple(members))


def member_state(evalset: EvalSet, member: Member) -> dict[str, Any]:
    """What is known of a member without running it: pending, started or done (and its headline)."""
    run_dir = evalset.run_dir(member)
    state: dict[str, Any] = {"member": member.name, "run": str(run_dir), "state": "pending"}
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            summary = {}
        state["state"] = "done"
        for key in ("completed", "failed", "requested", "fingerprint"):
            if key in summary:
                state[key] = summary[key]
    elif run_dir.exists():
        state["state"] = "started"
    return state

"""The Helm route of an eval set (``shopsimrl evalset SET.yaml --helm-values DIR``): one values
file per member for the chart (helm/shopsimrl), one release per member; nothing runs here.

A pod plans from its config alone, so each values file carries the member's whole config: its
YAML as written with the set's and the member's overrides put in (``config``, a mapping), the
experiment name the member's local run derives (the chart mounts the config under the run name,
whose stem would otherwise become the name) and its split file inline (``run.inlineSplitFile``,
kept under the file name the config names: only the name is fingerprinted). Before a file is
written, the config as the pod reads it is planned here and must give the member's own plan
fingerprint, so the release plans exactly what ``shopsimrl evalset`` would run locally.

The set's location must be in object storage (``s3://``): a release's pods cannot reach a local
folder. Each member runs at ``<location>/<member>``, where the set itself would put it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from shopsimrl.config import ConfigError, ExperimentConfig, read_yaml_mapping
from shopsimrl.runner.evalset import EvalSet, Member, load_evalset
from shopsimrl.runner.experiment import prepare
from shopsimrl.schemas import fingerprint, redact_uri

__all__ = ["EvalSetHelmError", "MemberRelease", "member_release", "write_helm_values"]

_RUN_NAME: Final = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")  # the chart's run.name
_RELEASE_MAX: Final = 53  # Helm's limit on a release name


class EvalSetHelmError(ConfigError):
    """The set cannot become Helm releases; the message names the file, the line and the field."""


@dataclass(frozen=True)
class MemberRelease:
    member: str
    release: str
    run_name: str
    run_uri: str
    fingerprint: str
    values: dict[str, Any]

    def text(self, set_path: Path) -> str:
        head = (
            f"# Helm values for member {self.member!r} of the eval set {set_path.name} (written by `shopsimrl evalset "
            "--helm-values`; do not edit).\n"
            "# Add your cluster's values (storage, model, ShopSimulator) in another file:\n"
            f"#   helm install {self.release} helm/shopsimrl -f my-values.yaml -f THIS_FILE\n"
            f"# The pods plan {self.fingerprint}, the member's local plan.\n"
        )
        return head + yaml.safe_dump(self.values, allow_unicode=True, sort_keys=False, width=10_000)


def _location(path: Path) -> tuple[str, int]:
    """The set's ``location`` as written, and its line."""
    root = yaml.compose(path.read_text(encoding="utf-8"))
    for key, value in root.value if isinstance(root, yaml.MappingNode) else ():
        if isinstance(key, yaml.ScalarNode) and key.value == "location" and isinstance(value, yaml.ScalarNode):
            return str(value.value), key.start_mark.line + 1
    return "", 1  # load_evalset has refused a set without one


def run_name(member: str) -> str:
    """The chart's run name for a member: the name itself when the chart takes it (at most 63
    characters, a letter or digit at both ends)."""
    return member if _RUN_NAME.match(member) else member[:63].rstrip("._-")


def release_name(member: str) -> str:
    """A Helm release name (DNS-1123: lower case, digits, '-'; at most 53) for a member."""
    return re.sub(r"[^a-z0-9-]+", "-", member.lower())[:_RELEASE_MAX].strip("-") or "member"


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    """``value`` at the dotted ``key`` (sections made as needed), as ``--set`` puts it; a path is
    kept as written, to resolve in the image's configs like the chart's ``config``."""
    *sections, last = key.split(".")
    node = data
    for segment in sections:
        child = node.get(segment)
        if not isinstance(child, dict):
            child = node[segment] = {}
        node = child
    node[last] = value


def member_release(the_set: EvalSet, member: Member, uri: str, shards: int) -> MemberRelease:
    """The values of the release that runs ``member`` at ``uri``, checked to plan the member's plan."""
    where = f"{the_set.path}:{member.line}: member {member.name!r}"
    local = the_set.member_config(member)
    local_fingerprint = fingerprint(prepare(local).plan())
    data = copy.deepcopy(read_yaml_mapping(member.config, "config"))
    for override in member.overrides:
        _put(data, override.key, override.value)
    if the_set.concurrency is not None:
        _put(data, "experiment.concurrency", the_set.concurrency)
    experiment = data.setdefault("experiment", {})
    experiment["name"] = local.name
    # Local settings a pod has no use for (it writes to the run URI, gets secrets from the chart).
    for key in ("output_dir", "dotenv"):
        experiment.pop(key, None)
    split_path = local.resolve(local.tasks.split_file)
    try:
        split_text = split_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalSetHelmError(f"{where}: cannot read its split file {split_path}: {exc}") from None
    data["tasks"]["split_file"] = split_path.name
    # The config as the pod reads it: the split under the same file name, the other paths as written.
    pod = {**data, "tasks": {**data["tasks"], "split_file": str(split_path)}}
    try:
        pod_config = ExperimentConfig.model_validate({**pod, "source_path": member.config.resolve()})
        pod_fingerprint = fingerprint(prepare(pod_config).plan())
    except (ValueError, ConfigError) as exc:
        raise EvalSetHelmError(f"{where}: the Helm values would not plan: {exc}") from None
    if pod_fingerprint != local_fingerprint:  # a bug here, not in the set
        raise EvalSetHelmError(f"{where}: the Helm values plan {pod_fingerprint[:12]}, not the member's {local_fingerprint[:12]}")
    name = run_name(member.name)
    values = {
        "config": data,
        "run": {"name": name, "uri": redact_uri(uri), "inlineSplitFile": split_text},
        "job": {"shards": shards},
    }
    return MemberRelease(member.name, release_name(member.name), name, uri, local_fingerprint, values)


def write_helm_values(set_path: Path, out_dir: Path, shards: int) -> list[MemberRelease]:
    """Every member's values file written to ``out_dir/<member>.yaml``; all are made (and checked)
    before any is written, so a bad member leaves no half set."""
    the_set = load_evalset(set_path, remote=True)
    location, line = _location(set_path)
    if not location.startswith("s3://"):
        raise EvalSetHelmError(
            f"{set_path}:{line}: location: --helm-values needs the set's location in object storage "
            f"(s3://bucket/prefix), not {location!r}: a release's pods cannot reach a local folder"
        )
    if shards < 1:
        raise EvalSetHelmError(f"--shards {shards}: must be at least 1")
    releases = [member_release(the_set, member, f"{location.rstrip('/')}/{member.name}", shards) for member in the_set.members]
    seen: dict[str, str] = {}
    for release in releases:
        for kind, key in (("release", release.release), ("run name", release.run_name.lower())):
            other = seen.setdefault(f"{kind}:{key}", release.member)
            if other != release.member:
                raise EvalSetHelmError(
                    f"{set_path}: members {other!r} and {release.member!r} give the same Helm {kind} {key!r}; rename one"
                )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for release in releases:
            (out_dir / f"{release.member}.yaml").write_text(release.text(set_path), encoding="utf-8")
    except OSError as exc:
        raise EvalSetHelmError(f"--helm-values {out_dir}: cannot write: {exc.strerror or exc}") from None
    return releases

"""Helm values for a gate's sharded masked rollouts (``gate plan --shards N --run URI --helm-values F``).

A pod of the chart plans from its config alone, like every worker, so the release must carry
everything the masked plan is made of: the experiment config, the split file and
``skill_assignments.json``. The config is the bare experiment's own YAML (its paths still relative
to its directory, which is how the image's ``/app/configs`` holds the repository's configs) with
the masked run's name and ``skills.path``; split and assignments travel inline
(``run.inlineSplitFile``, ``run.inlineSkillsFile``), mounted by the chart under the file names the
config names. File names and contents are what the plan fingerprints (never a directory), so the
pods plan exactly the masked plan frozen here; :func:`helm_values` checks that by planning from
the files as the pods will see them.

The three share one ConfigMap, which Kubernetes caps at 1 MiB of keys and values: a gate over it
is refused here (exit 2) rather than at ``helm install``.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any, Final

import yaml

from shopsimrl.config import load_experiment_config
from shopsimrl.research.gate.freeze import ASSIGNMENTS_FILE, FrozenGate, GatePlanError
from shopsimrl.runner.experiment import prepare
from shopsimrl.schemas import fingerprint, redact_uri

__all__ = ["CONFIGMAP_LIMIT_BYTES", "configmap_bytes", "helm_values"]

CONFIGMAP_LIMIT_BYTES: Final = 1024 * 1024
"""Kubernetes refuses a ConfigMap whose keys and values add up to more (``MaxSecretSize``)."""
_RUN_NAME: Final = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")  # the chart's run.name


def configmap_bytes(files: dict[str, str]) -> int:
    """What the chart's ConfigMap counts against the limit (the same sum its render checks): each
    key and value in UTF-8, plus the newline a block scalar ends with."""
    return sum(len(key.encode("utf-8")) + len(text.encode("utf-8")) + 1 for key, text in files.items())


class _Block(yaml.SafeDumper):
    """Multi-line strings as literal blocks, so the values file shows the files as they are."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Block.add_representer(str, _str)


def _source_config(frozen: FrozenGate) -> tuple[dict[str, Any], Path]:
    """The bare experiment's YAML as written, with the masked run's name and skills; and its split file."""
    source = frozen.spec.experiment_config
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    experiment = data.setdefault("experiment", {})
    experiment["name"] = frozen.spec.gate_dir.name
    # Local settings a pod has no use for (it writes to the run URI, gets secrets from the chart),
    # and which would carry this machine's layout into the release.
    for key in ("output_dir", "dotenv"):
        experiment.pop(key, None)
    data["skills"] = {"path": ASSIGNMENTS_FILE}
    split_file = frozen.experiment.resolve(frozen.experiment.tasks.split_file)
    # Only its file name counts (the split's identity holds no directory), and the file travels inline.
    data["tasks"]["split_file"] = split_file.name
    return data, split_file


def _check_pod_plan(frozen: FrozenGate, config: dict[str, Any], split_text: str, skills_text: str) -> None:
    """Plan from the files laid out as the chart mounts them; it must be the frozen masked plan."""
    with tempfile.TemporaryDirectory(prefix="shopsimrl-helm-") as scratch:
        root = Path(scratch)
        split_name = os.path.basename(str(config["tasks"]["split_file"]))
        (root / "inline" / "split").mkdir(parents=True)
        (root / "inline" / "skills").mkdir(parents=True)
        (root / "inline" / "split" / split_name).write_text(split_text, encoding="utf-8")
        (root / "inline" / "skills" / ASSIGNMENTS_FILE).write_text(skills_text, encoding="utf-8")
        pod = {**config, "tasks": {**config["tasks"], "split_file": f"inline/split/{split_name}"}}
        pod["skills"] = {"path": f"inline/skills/{ASSIGNMENTS_FILE}"}
        prompt = (config.get("prompt") or {}).get("system_prompt_file")
        if isinstance(prompt, str):  # resolved in the image's /app/configs as beside the source config
            pod["prompt"] = {**config["prompt"], "system_prompt_file": str(frozen.experiment.resolve(prompt))}
        path = root / "config.yaml"
        path.write_text(yaml.safe_dump(pod, allow_unicode=True, sort_keys=False), encoding="utf-8")
        try:
            planned = prepare(load_experiment_config(path, load_dotenv=False).with_overrides(frozen.settings))
        except ValueError as exc:
            raise GatePlanError(f"the Helm values would not plan: {exc}") from None
        if fingerprint(planned.plan()) != frozen.masked_fingerprint:
            raise GatePlanError("the Helm values do not reproduce the gate's masked plan")  # a writer bug


def helm_values(frozen: FrozenGate, run: str, shards: int) -> str:
    """The values file (YAML text) for the chart to run the masked rollouts at ``run``."""
    if "://" not in run:
        raise GatePlanError(
            f"--helm-values needs --run in object storage (s3://…), not {run}: the release's pods cannot reach a local directory"
        )
    config, split_file = _source_config(frozen)
    try:
        split_text = split_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GatePlanError(f"cannot read the split file {split_file} for the Helm values: {exc}") from None
    skills_text = (frozen.spec.gate_dir / ASSIGNMENTS_FILE).read_text(encoding="utf-8")
    config_text = yaml.safe_dump(config, allow_unicode=True, sort_keys=False)
    name = frozen.spec.gate_dir.name
    run_block: dict[str, Any] = {"name": name} if _RUN_NAME.match(name) else {}
    key = f"{name if run_block else 'RELEASE'}.yaml"  # the chart names the config after the run
    files = {key: config_text, "split.json": split_text, "skills.json": skills_text}
    size = configmap_bytes(files)
    if size > CONFIGMAP_LIMIT_BYTES:
        parts = ", ".join(f"{k} {len(v.encode('utf-8'))}" for k, v in files.items())
        raise GatePlanError(
            f"the Helm release's ConfigMap would hold {size} bytes ({parts}), over Kubernetes' 1 MiB "
            f"({CONFIGMAP_LIMIT_BYTES} bytes) limit: run the masked rollouts with `shopsimrl run "
            "masked_experiment.yaml --shards N --run URI` or workers instead, or gate fewer tasks"
        )
    _check_pod_plan(frozen, config, split_text, skills_text)
    values = {
        "config": config_text,
        "run": {**run_block, "uri": redact_uri(run), "inlineSplitFile": split_text, "inlineSkillsFile": skills_text},
        "job": {"shards": shards},
    }
    head = (
        f"# Helm values for the masked rollouts of the skill gate {frozen.spec.source.name} (written by `shopsimrl gate "
        "plan`; do not edit).\n"
        "# Add your cluster's values (storage, model, ShopSimulator) in another file:\n"
        "#   helm install NAME helm/shopsimrl -f my-values.yaml -f THIS_FILE\n"
        f"# The pods plan the masked plan {frozen.masked_fingerprint}; then `shopsimrl gate fit` reads the run.\n"
    )
    return head + yaml.dump(values, Dumper=_Block, allow_unicode=True, sort_keys=False, width=10_000)

"""A skill gate's masked rollouts through the Helm chart: `gate plan --shards N --run URI
--helm-values F` writes the release's values, the chart renders valid Kubernetes, the rendered
pods plan exactly the frozen masked plan from the files the chart mounts, the worker and reducer
containers run as local processes against the testbed and moto S3, and `gate fit` on that run
gives the same contributions as the gate run locally."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from shopsimrl.exitcodes import ExitCode
from tests.sharded.conftest import _make_bucket
from tests.test_chart import (
    CHART,
    Helm,
    _materialize_config,
    _pod_command,
    container,
    env_of,
    helm,
    only,
    parse_docs,
    validate_all,
)

from .conftest import ResearchRuns
from .test_gate_cli import CHUNKS, gate, research_config, write_draft, write_gate

__all__ = ["helm"]  # the chart tests' session fixture

pytestmark = [pytest.mark.chart, pytest.mark.s3, pytest.mark.slow]

# The cluster's own values, as an operator keeps them: storage and the shared services.
CLUSTER_VALUES = {
    "storage": {
        "endpointUrl": "http://minio:9000",
        "credentials": {"existingSecret": "s3-credentials"},
    },
    "model": {"baseUrl": "http://policy:8000/v1"},
    "environment": {"baseUrl": "http://shop:5700"},
    "reducer": {"enabled": True, "timeoutSeconds": 300},
    "worker": {"flushEpisodes": 4, "flushSeconds": 2},
}


def _contribution_rows(document: dict[str, Any]) -> dict[str, Any]:
    return {row["chunk_id"]: row for row in document["contributions"]}


def test_a_gate_runs_through_the_chart_and_fits_like_the_local_gate(
    helm: Helm, tmp_path: Path, research_runs: ResearchRuns, moto_endpoint: str, testbed: Any
) -> None:
    env = {**os.environ, **research_runs.env}
    draft = write_draft(tmp_path / "draft", CHUNKS)
    common = {
        "experiment_config": str(research_config(research_runs)),
        "bare_run_dir": str(research_runs.local),
        "draft_path": str(draft),
    }
    # The same gate run locally, for the reference numbers.
    local = gate("run", str(write_gate(tmp_path / "local.yaml", output_dir=str(tmp_path / "local"), **common)), "--no-progress")
    assert local.returncode == 0, local.stderr[-3000:]
    reference = json.loads((tmp_path / "local" / "contributions.json").read_text(encoding="utf-8"))

    bucket = _make_bucket(moto_endpoint, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    uri = f"s3://{bucket}/gates/helm-gate"
    gate_yaml = write_gate(tmp_path / "helm.yaml", output_dir=str(tmp_path / "helm-gate"), **common)
    values = tmp_path / "gate-values.yaml"
    planned = gate("plan", str(gate_yaml), "--shards", "2", "--run", uri, "--helm-values", str(values), env=env)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert f"helm values     {values}" in planned.stdout
    gate_plan = json.loads((tmp_path / "helm-gate" / "gate_plan.json").read_text(encoding="utf-8"))
    written = yaml.safe_load(values.read_text(encoding="utf-8"))
    assert written["run"]["uri"] == uri and written["job"] == {"shards": 2} and written["run"]["name"] == "helm-gate"
    assert json.loads(written["run"]["inlineSkillsFile"]) == json.loads(
        (tmp_path / "helm-gate" / "skill_assignments.json").read_text(encoding="utf-8")
    )
    assert "testing-secret" not in values.read_text(encoding="utf-8")
    config = yaml.safe_load(written["config"])
    assert "output_dir" not in config["experiment"] and config["tasks"]["split_file"] == "persona_splits.v1.json"
    assert str(tmp_path) not in values.read_text(encoding="utf-8")

    cluster = tmp_path / "cluster-values.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER_VALUES), encoding="utf-8")
    proc = helm.run("template", "gate1", str(CHART), "--namespace", "evals", "-f", str(cluster), "-f", str(values))
    assert "warning" not in proc.stderr.lower(), proc.stderr
    docs = parse_docs(proc.stdout)
    assert validate_all((d.body for d in docs), "gate values") == len(docs)
    job = only(docs, "Job", "job-worker.yaml")
    pod = job["spec"]["template"]["spec"]
    worker = container(pod, "worker")
    mounts = {m["mountPath"]: m["subPath"] for m in worker["volumeMounts"] if m["name"] == "config"}
    assert mounts == {
        "/app/configs/helm-gate.yaml": "helm-gate.yaml",
        "/app/configs/inline/split/persona_splits.v1.json": "split.json",
        "/app/configs/inline/skills/skill_assignments.json": "skills.json",
    }
    assert env_of(worker)["SHOPSIMRL_RUN"]["value"] == uri and job["spec"]["completions"] == 2

    # The pods plan the frozen masked plan from exactly the files the chart mounts.
    from shopsimrl.config import load_experiment_config
    from shopsimrl.runner.experiment import prepare
    from shopsimrl.schemas import fingerprint

    config_path = _materialize_config(docs, tmp_path / "pod")
    pod_plan = prepare(load_experiment_config(config_path, load_dotenv=False)).plan()
    assert fingerprint(pod_plan) == gate_plan["masked_plan_fingerprint"]
    assert pod_plan["skills"]["provider"] == "assigned_skills"

    overrides = {
        "SHOPSIMRL_CONFIG": str(config_path),
        "SHOPSIMRL_MODEL_BASE_URL": testbed.model_url,
        "SHOPSIMRL_ENV_BASE_URL": testbed.shop_url,
        "AWS_ENDPOINT_URL": moto_endpoint,
        "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
        "SHOPSIMRL_LOG_FORMAT": "console",
    }
    argv, pod_env = _pod_command(container(pod, "wait-ready"), overrides)
    ready = subprocess.run(argv, env=pod_env, capture_output=True, text=True, timeout=120)
    assert ready.returncode == ExitCode.OK, ready.stderr[-3000:]
    workers = []
    for index in range(2):
        argv, pod_env = _pod_command(worker, overrides, {"JOB_COMPLETION_INDEX": str(index)})
        workers.append(subprocess.Popen(argv, env=pod_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for index, process in enumerate(workers):
        out, _ = process.communicate(timeout=300)
        assert process.returncode == ExitCode.OK, f"shard {index}:\n{out[-3000:]}"
    reducer = only(docs, "Job", "job-reducer.yaml")["spec"]["template"]["spec"]["containers"][0]
    argv, pod_env = _pod_command(reducer, overrides)
    reduced = subprocess.run(argv, env=pod_env, capture_output=True, text=True, timeout=300)
    assert reduced.returncode == ExitCode.OK, reduced.stdout[-3000:] + reduced.stderr[-3000:]

    fitted = gate("fit", str(gate_yaml), env=env)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    document = json.loads((tmp_path / "helm-gate" / "contributions.json").read_text(encoding="utf-8"))
    assert document["estimates"] == reference["estimates"]
    assert _contribution_rows(document) == _contribution_rows(reference)
    manifest = json.loads((tmp_path / "helm-gate" / "gate_a_manifest.json").read_text(encoding="utf-8"))
    assert manifest["runs"]["masked"] == uri and manifest["summary"]["shard_states"] == {"0": "committed", "1": "committed"}


def test_helm_values_need_object_storage_and_fit_the_config_map(
    tmp_path: Path, research_runs: ResearchRuns, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**os.environ, **research_runs.env}
    section = {
        "output_dir": str(tmp_path / "g"),
        "experiment_config": str(research_config(research_runs)),
        "bare_run_dir": str(research_runs.local),
        "draft_path": str(write_draft(tmp_path / "draft", CHUNKS)),
    }
    gate_yaml = write_gate(tmp_path / "gate.yaml", **section)
    values = tmp_path / "values.yaml"
    local = gate("plan", str(gate_yaml), "--shards", "2", "--run", str(tmp_path / "masked"), "--helm-values", str(values))
    assert local.returncode == 2 and "--helm-values needs --run in object storage" in local.stderr
    alone = gate("plan", str(gate_yaml), "--helm-values", str(values))
    assert alone.returncode == 2 and "--helm-values needs --shards N --run URI" in alone.stderr
    assert not values.exists()

    # The ConfigMap limit, checked by the planner with the chart's own count (lowered here: the
    # fixture's 24-task gate is far below 1 MiB).
    from shopsimrl.research.gate import helm as gate_helm
    from shopsimrl.research.gate.commands import plan_gate
    from shopsimrl.research.gate.freeze import GatePlanError

    for name, value in research_runs.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(gate_helm, "CONFIGMAP_LIMIT_BYTES", 10_000)
    bucket = _make_bucket(env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(GatePlanError, match=r"ConfigMap would hold \d+ bytes \(g\.yaml \d+, split\.json 65\d\d\d, skills\.json"):
        plan_gate(gate_yaml, shards=2, run=f"s3://{bucket}/g", helm_values=values)
    assert not values.exists()

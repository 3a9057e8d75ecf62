"""The Helm route of an eval set: `evalset SET.yaml --helm-values DIR` writes one values file per
member; each renders with a real Helm into valid Kubernetes, and the config the release mounts
plans exactly the member's local plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shopsimrl.cli import app
from shopsimrl.config import load_experiment_config
from shopsimrl.runner.evalset import load_evalset
from shopsimrl.runner.evalset_helm import EvalSetHelmError, release_name, run_name, write_helm_values
from shopsimrl.runner.experiment import prepare
from shopsimrl.schemas import fingerprint
from tests.test_chart import CHART, Helm, _materialize_config, container, env_of, helm, only, parse_docs, validate_all
from tests.testbed_process import write_config

__all__ = ["helm"]  # the chart tests' session fixture

SET = """location: s3://evals/sets/rounds
config: base.yaml
set: {runtime.max_steps: 20}
concurrency: 3
members:
  - {name: round-1, checkpoint: ck-1}
  - {name: Round_2, checkpoint: ck-2, model: other-model}
  - {name: round-3., checkpoint: ck-3, set: {model.temperature: 0.5, tasks.sample_size: 2}}
"""
CLUSTER_VALUES = {"model": {"baseUrl": "http://policy:8000/v1"}, "environment": {"baseUrl": "http://shop:5700"}}


def write_set(directory: Path, text: str = SET) -> Path:
    write_config(directory, name="base", sample_size=3)
    path = directory / "set.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_values_carry_each_member_config_uri_and_shards(tmp_path: Path) -> None:
    path = write_set(tmp_path)
    out = tmp_path / "values"
    result = CliRunner().invoke(app, ["evalset", str(path), "--helm-values", str(out), "--shards", "3"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("helm install")]
    assert lines == [
        f"helm install round-1 helm/shopsimrl -f my-values.yaml -f {out}/round-1.yaml",
        f"helm install round-2 helm/shopsimrl -f my-values.yaml -f {out}/Round_2.yaml",
        f"helm install round-3 helm/shopsimrl -f my-values.yaml -f {out}/round-3..yaml",
    ]
    values = {
        name: yaml.safe_load((out / f"{name}.yaml").read_text(encoding="utf-8")) for name in ("round-1", "Round_2", "round-3.")
    }
    assert values["round-1"]["run"]["uri"] == "s3://evals/sets/rounds/round-1"
    assert values["round-3."]["run"]["name"] == "round-3"  # the chart's run name ends in a letter or digit
    assert all(v["job"] == {"shards": 3} for v in values.values())
    config = values["round-3."]["config"]
    assert config["model"]["checkpoint_id"] == "ck-3" and config["model"]["temperature"] == 0.5
    assert config["runtime"]["max_steps"] == 20 and config["experiment"]["concurrency"] == 3
    assert config["tasks"]["split_file"] == "persona_splits.v1.json" and "output_dir" not in config["experiment"]
    assert values["Round_2"]["config"]["model"]["name"] == "other-model" and values["Round_2"]["config"]["model"]["id"] is None
    assert all(str(tmp_path) not in (out / f"{name}.yaml").read_text(encoding="utf-8") for name in values)
    assert not (tmp_path / "s3:").exists()  # nothing ran


def test_a_local_location_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = write_set(tmp_path, SET.replace("s3://evals/sets/rounds", "sets/rounds"))
    result = CliRunner().invoke(app, ["evalset", str(path), "--helm-values", str(tmp_path / "values")])
    assert result.exit_code == 2
    assert f"{path}:1: location: --helm-values needs the set's location in object storage" in result.output
    assert not (tmp_path / "values").exists()


def test_members_that_meet_in_one_release_name_are_refused(tmp_path: Path) -> None:
    path = write_set(tmp_path, SET.replace("Round_2", "round_1"))
    with pytest.raises(EvalSetHelmError, match="members 'round-1' and 'round_1' give the same Helm release 'round-1'"):
        write_helm_values(path, tmp_path / "values", 1)
    assert not (tmp_path / "values").exists()


def test_names_for_the_chart_and_helm() -> None:
    assert run_name("a.") == "a" and run_name("x" * 64) == "x" * 63 and run_name("ok_1") == "ok_1"
    assert release_name("Round_2.b") == "round-2-b" and len(release_name("a" * 64)) == 53


@pytest.mark.chart
@pytest.mark.slow
def test_three_releases_render_valid_and_plan_each_member_plan(helm: Helm, tmp_path: Path) -> None:
    path = write_set(tmp_path)
    releases = write_helm_values(path, tmp_path / "values", 2)
    the_set = load_evalset(path, remote=True)
    cluster = tmp_path / "cluster-values.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER_VALUES), encoding="utf-8")
    fingerprints = set()
    for release, member in zip(releases, the_set.members, strict=True):
        values = tmp_path / "values" / f"{member.name}.yaml"
        proc = helm.run("template", release.release, str(CHART), "--namespace", "evals", "-f", str(cluster), "-f", str(values))
        assert "warning" not in proc.stderr.lower(), proc.stderr
        docs = parse_docs(proc.stdout)
        assert validate_all((doc.body for doc in docs), member.name) == len(docs)
        job = only(docs, "Job", "job-worker.yaml")
        assert env_of(container(job["spec"]["template"]["spec"], "worker"))["SHOPSIMRL_RUN"]["value"] == release.run_uri
        assert job["spec"]["completions"] == 2
        # The config the release mounts, read as the pod reads it, plans the member's local plan.
        mounted = _materialize_config(docs, tmp_path / "pod" / member.name)
        pod_plan = fingerprint(prepare(load_experiment_config(mounted, load_dotenv=False)).plan())
        local_plan = fingerprint(prepare(the_set.member_config(member)).plan())
        assert pod_plan == local_plan == release.fingerprint
        fingerprints.add(pod_plan)
    assert len(fingerprints) == 3  # three checkpoints, three plans

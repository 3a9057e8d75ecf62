"""Gate A end to end on the real testbed: the shipped demo (configs/gate_demo, the 400 persona val
tasks) through the real CLI, with chunks whose true effects are known (docs/testbed.md, "Skills");
then the same gate with its masked rollouts sharded on moto S3 by the ordinary `run --shards`.

Cost on the 2-core machine: the bare run and each masked run take about 30 s each (400 episodes);
the module takes about 2 minutes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.sharded.conftest import REPO, S3_TEST_ENV, SPLIT_FILE, _make_bucket, cli
from tests.testbed_process import LocalTestbed, start_testbed

pytestmark = pytest.mark.slow

CHUNKS = ["concise-replies", "choose-options", "buy-first-result"]


@dataclass
class Demo:
    configs: Path
    runs: Path
    env: dict[str, str]
    bed: LocalTestbed

    @property
    def gate_dir(self) -> Path:
        return self.runs / "gate"

    def gate(self, *args: str, env: dict[str, str] | None = None) -> Any:
        return cli("gate", *args, env=env or self.env, timeout=600)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """The shipped demo configs in a scratch tree (their relative paths unchanged), a testbed whose
    policy chooses options only when a skill says so, and the bare val run made by `shopsimrl run`."""
    root = tmp_path_factory.mktemp("gate-demo")
    configs = root / "configs" / "gate_demo"
    shutil.copytree(REPO / "configs" / "gate_demo", configs)
    (root / "configs" / "splits").mkdir()
    shutil.copy(SPLIT_FILE, root / "configs" / "splits" / SPLIT_FILE.name)
    with start_testbed(SHOPSIM_POLICY_OPTIONS_NEED_SKILL="1") as bed:
        env = bed.env(SHOPSIMRL_LOG_LEVEL="warning")
        bare = cli("run", str(configs / "bare.yaml"), "--no-progress", env=env, timeout=600)
        assert bare.returncode == 0, bare.stderr[-3000:]
        yield Demo(configs, root / "runs" / "gate-demo", env, bed)


@pytest.fixture(scope="module")
def local_gate(demo: Demo) -> dict[str, Any]:
    result = demo.gate("run", str(demo.configs / "gate.yaml"), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    print(result.stdout)  # the fit table, for the record (pytest -s)
    return json.loads((demo.gate_dir / "contributions.json").read_text(encoding="utf-8"))


def rows_by_id(contributions: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["chunk_id"]: row for row in contributions["contributions"]}


def test_gate_a_finds_the_known_effects(demo: Demo, local_gate: dict[str, Any]) -> None:
    rows = rows_by_id(local_gate)
    helpful, noop, harmful = rows["choose-options"], rows["concise-replies"], rows["buy-first-result"]
    assert helpful["status"] == "selected" and helpful["coefficient"] > 0 and helpful["rank"] == 1
    assert harmful["coefficient"] < 0 and harmful["ci_high"] < 0 and harmful["status"] == "non_positive"
    assert noop["ci_low"] < 0 < noop["ci_high"]
    assert local_gate["selected_chunk_ids"] == ["choose-options"]
    assert local_gate["observations"] == 400 and local_gate["estimates"]["reward"]["intercept"] == 0.0
    assert local_gate["bare_baseline"]["run"] == "../bare"  # no absolute path in the gate's files
    assert set(local_gate["estimates"]) >= {"reward", "r_strict", "r_success", "r_option"}

    selected = json.loads((demo.gate_dir / "selected_skillbank.json").read_text(encoding="utf-8"))
    assert [skill["skill_id"] for skill in selected["skills"]] == ["choose-options"]
    assert "draft_only" not in selected["skills"][0]["metadata"]
    assert "[[testbed:choose-options]]" in (demo.gate_dir / "selected_skill.md").read_text(encoding="utf-8")
    ledger = [json.loads(line) for line in (demo.gate_dir / "proposal_ledger.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [row["candidate_id"] for row in ledger] == CHUNKS
    assert (
        (demo.gate_dir / "contributions.csv").read_text(encoding="utf-8").splitlines()[0].startswith("chunk_id,draft_order,title")
    )

    masks = json.loads((demo.gate_dir / "mask_assignments.json").read_text(encoding="utf-8"))
    assert masks["chunk_ids"] == CHUNKS and masks["mask_seed"] == 20260901 and len(masks["assignments"]) == 400
    row = masks["assignments"][0]
    assert {"episode_id", "task_id", "sample_id", "mask", "included_chunk_ids"} <= set(row)
    assert row["included_chunk_ids"] == [c for c, bit in zip(CHUNKS, row["mask"], strict=True) if bit]

    assert json.loads((demo.gate_dir / "gate_plan.json").read_text(encoding="utf-8"))["masked_run"] == "."
    manifest = json.loads((demo.gate_dir / "gate_a_manifest.json").read_text(encoding="utf-8"))
    assert manifest["status"] == "complete"
    assert manifest["protocol"]["mask_seed"] == 20260901 and manifest["protocol"]["split"] == "val"
    assert manifest["input"]["chunk_ids"] == CHUNKS
    assert manifest["runs"] == {
        "bare": "../bare",
        "masked": ".",
        "masked_plan_fingerprint": manifest["runs"]["masked_plan_fingerprint"],
    }

    # Every masked rollout was shown exactly its mask's chunks, in draft order.
    shown = {}
    for line in (demo.gate_dir / "traces.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        shown[record["episode_id"]] = [skill["skill_id"] for skill in record["selected_skills"]]
    assert shown == {a["episode_id"]: a["included_chunk_ids"] for a in masks["assignments"]}


def test_a_rerun_runs_nothing_and_a_refit_gives_the_same_numbers(demo: Demo, local_gate: dict[str, Any]) -> None:
    bare_traces = (demo.runs / "bare" / "traces.jsonl").read_bytes()
    masked_traces = (demo.gate_dir / "traces.jsonl").read_bytes()
    again = demo.gate("run", str(demo.configs / "gate.yaml"), "--no-progress")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "400 already completed, 0 to run" in again.stderr
    refit = demo.gate("fit", str(demo.configs / "gate.yaml"))
    assert refit.returncode == 0, refit.stderr[-3000:]
    assert (demo.runs / "bare" / "traces.jsonl").read_bytes() == bare_traces  # the bare run is reused, never rerun
    assert (demo.gate_dir / "traces.jsonl").read_bytes() == masked_traces
    refitted = json.loads((demo.gate_dir / "contributions.json").read_text(encoding="utf-8"))
    assert refitted["estimates"] == local_gate["estimates"]
    assert rows_by_id(refitted) == rows_by_id(local_gate)


@pytest.mark.s3
def test_the_same_gate_sharded_on_s3_gives_identical_contributions(
    demo: Demo, local_gate: dict[str, Any], moto_endpoint: str
) -> None:
    bucket = _make_bucket(moto_endpoint, S3_TEST_ENV["AWS_ACCESS_KEY_ID"], S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"])
    env = {**demo.env, **S3_TEST_ENV, "AWS_ENDPOINT_URL": moto_endpoint}
    uri = f"s3://{bucket}/gate-masked"
    sharded_yaml = demo.configs / "gate-s3.yaml"
    sharded_yaml.write_text(
        (demo.configs / "gate.yaml").read_text(encoding="utf-8").replace("runs/gate-demo/gate", "runs/gate-demo/gate-s3"),
        encoding="utf-8",
    )
    gate_dir = demo.runs / "gate-s3"

    planned = demo.gate("plan", str(sharded_yaml), "--shards", "4", "--run", uri, env=env)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "4 shards, frozen" in planned.stdout
    refused = demo.gate("run", str(sharded_yaml), env=env)
    assert refused.returncode == 2 and "sharded masked rollouts" in refused.stderr

    # The masked rollouts are an ordinary frozen plan: the ordinary sharded run executes them.
    ran = cli(
        "run", str(gate_dir / "masked_experiment.yaml"), "--shards", "4", "--run", uri, "--no-progress", env=env, timeout=600
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    fitted = demo.gate("fit", str(sharded_yaml), env=env)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    sharded = json.loads((gate_dir / "contributions.json").read_text(encoding="utf-8"))
    assert sharded["estimates"] == local_gate["estimates"]
    assert rows_by_id(sharded) == rows_by_id(local_gate)
    manifest = json.loads((gate_dir / "gate_a_manifest.json").read_text(encoding="utf-8"))
    assert manifest["runs"]["masked"] == uri and manifest["summary"]["shard_states"] == {
        "0": "committed",
        "1": "committed",
        "2": "committed",
        "3": "committed",
    }
    assert "testing-secret" not in json.dumps(manifest)

"""An eval set's `tracking:` block: one tracker run per member, named by the member, logged as
`run --track` logs a run (W&B offline into a temporary folder, read back from its files); a
tracker that fails (MLflow with nothing listening) changes no exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shopsimrl.cli import app
from shopsimrl.testbed.serving import free_port
from tests.research.trackers import offline_runs, read_wandb_run, wandb_environment
from tests.testbed_process import ROOT, start_testbed, write_config

SET = """location: sets/tracked
config: base.yaml
set: {{runtime.max_steps: 20}}
tracking:
  backends: [wandb, mlflow]
  mode: offline
  dir: wandb-runs
  project: shopsimrl-evalset-tests
  tags: [evalset]
  tracking_uri: http://127.0.0.1:{closed}
members:
  - {{name: round-1, checkpoint: ck-1}}
  - {{name: round-2, checkpoint: ck-2}}
"""


@pytest.mark.slow
def test_each_member_gets_its_own_tracker_run_and_a_failing_tracker_changes_nothing(tmp_path: Path) -> None:
    write_config(tmp_path, name="base", sample_size=3)
    set_path = tmp_path / "set.yaml"
    set_path.write_text(SET.format(closed=free_port()), encoding="utf-8")  # nothing listens there
    with start_testbed() as bed:
        env = {
            **wandb_environment(tmp_path / "wandb-home"),
            "SHOPSIMRL_MODEL_BASE_URL": bed.model_url,
            "SHOPSIMRL_ENV_BASE_URL": bed.shop_url,
        }
        result = subprocess.run(
            [sys.executable, "-m", "shopsimrl", "evalset", str(set_path), "--no-progress", "--no-report"],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=300,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("tracked in wandb: W&B offline run") == 2, result.stderr[-3000:]
    assert result.stderr.count("tracker_failed") == 2  # MLflow, once per member

    runs = {}
    for directory in offline_runs(tmp_path / "wandb-runs"):  # `dir` is relative to SET.yaml
        run = read_wandb_run(directory)
        runs[run.name] = run
    assert sorted(runs) == ["round-1", "round-2"]
    for name, checkpoint in (("round-1", "ck-1"), ("round-2", "ck-2")):
        run = runs[name]
        summary = json.loads((tmp_path / "sets/tracked" / name / "summary.json").read_text(encoding="utf-8"))
        assert (run.project, run.job_type, run.exit_code) == ("shopsimrl-evalset-tests", "evaluation", 0)
        assert "evalset" in run.tags
        logged = run.config["shopsimrl"]
        assert logged["checkpoint_id"] == checkpoint == summary["run"]["checkpoint_id"]
        assert logged["plan_fingerprint"] == summary["run"]["plan_fingerprint"]
        assert run.summary["itt/score"] == pytest.approx(summary["intent_to_treat"]["score"])
        assert run.summary["tracking/episode_rows"] == 3


def test_a_bad_tracking_block_is_refused_before_anything_runs(tmp_path: Path) -> None:
    write_config(tmp_path, name="base", sample_size=3)
    set_path = tmp_path / "set.yaml"
    set_path.write_text(SET.format(closed=1).replace("[wandb, mlflow]", "[wandb, neptune]"), encoding="utf-8")
    result = CliRunner().invoke(app, ["evalset", str(set_path), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert f"{set_path}: tracking" in result.output and "backends" in result.output
    assert not (tmp_path / "sets").exists()

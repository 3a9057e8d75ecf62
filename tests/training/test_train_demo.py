"""`make train-demo` (scripts/train-demo.sh) end to end, in a copy of the repository's scripts and
configs, with the gate demo's selected bank already in place (the file `make gate-demo` writes,
checked in as a fixture so the test does not play the gate's 800 episodes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shopsimrl.storage.reading import open_run

REPO = Path(__file__).resolve().parents[2]
BANK = REPO / "tests/fixtures/train_demo/gate_demo_selected_skillbank.json"

pytestmark = pytest.mark.slow


def test_the_train_demo_plays_a_step_and_leaves_what_it_says(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    shutil.copytree(REPO / "scripts", root / "scripts")
    shutil.copytree(REPO / "configs", root / "configs")
    bank = root / "runs/gate-demo/gate/selected_skillbank.json"
    bank.parent.mkdir(parents=True)
    shutil.copyfile(BANK, bank)
    env = {key: value for key, value in os.environ.items() if not key.startswith("SHOPSIMRL_")}
    done = subprocess.run(
        ["bash", str(root / "scripts/train-demo.sh")],
        env={**env, "BIN": str(Path(sys.executable).parent)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = root / "runs/train-demo"
    step = json.loads((out / "round-001.json").read_text(encoding="utf-8"))
    # 16 groups asked for, 12 handed to the trainer; slime cancels what is still running then.
    assert len(step["kept_groups"]) == 12 and 12 <= len(step["groups"]) <= 16
    assert all(len({s["index"] for s in g["samples"]}) == 4 for g in step["groups"])
    metrics = step["metrics"]
    assert metrics["rollout/shopsim/train_group_count"] == 12
    assert metrics["rollout/shopsim/q"] == pytest.approx(0.2)
    assert metrics["rollout/shopsim/chunk/choose-options/target_rho"] == pytest.approx(0.9)
    # Every group of the step was drawn from the curriculum, the same draw for all its samples.
    for group in step["groups"]:
        assert len({tuple(s["skills"]) for s in group["samples"]}) == 1
    run = out / "round-001"
    triaged = {p.name for p in (run / "training/triage").glob("group-*.json")}
    # Every group the step collected was triaged; a group that finished while slime cancelled the
    # rest may be triaged without being collected, so the files can name a few more of the 16.
    assert {f"group-{g['group_index']:09d}.json" for g in step["groups"]} <= triaged
    assert triaged <= {f"group-{g:09d}.json" for g in range(16)}
    episodes = {record.episode_id for record in open_run(str(run)).records()}
    assert {s["episode_id"] for g in step["groups"] for s in g["samples"]} <= episodes
    assert "wrong_or_missing_options" in done.stdout and "train-demo: 5/5" in done.stdout

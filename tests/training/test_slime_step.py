"""`shopsimrl training step`: one slime-shaped rollout step through the real command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shopsimrl.storage.reading import open_run
from shopsimrl.testbed.policy import PolicySettings
from shopsimrl.testbed.policy import create_app as create_policy_app
from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings
from shopsimrl.testbed.shop import create_app as create_shop_app
from shopsimrl.training.grpo import grpo_advantages_by_rollout

REPO = Path(__file__).resolve().parents[2]
SPLITS = REPO / "configs/splits/persona_splits.v1.json"
TRAIN_IDS: list[int] = json.loads(SPLITS.read_text())["splits"]["train"]["task_ids"]

pytestmark = pytest.mark.slow


def _task_data(path: Path, ids: list[int]) -> Path:
    lines = [
        json.dumps({"prompt": str(t), "metadata": {"schema_version": "shopsimrl-slime-tasks-v1", "task_id": t, "split": "train"}})
        for t in ids
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _round(tmp_path: Path, shop: str, model: str, *extra: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "training.yaml"
    config.write_text(
        f"run: {{name: round-001, output_dir: {tmp_path / 'runs'}, concurrency: 8}}\n"
        f"tasks: {{split_file: {SPLITS}, split: train}}\n"
        f"environment: {{base_url: '{shop}'}}\n"
        f"model: {{base_url: '{model}', retry_backoff_seconds: 0.0}}\n",
        encoding="utf-8",
    )
    tasks = _task_data(tmp_path / "tasks.jsonl", TRAIN_IDS[:8])
    command = [sys.executable, "-m", "shopsimrl", "training", "step", str(config), "--task-data", str(tasks)]
    return subprocess.run([*command, *extra], capture_output=True, text=True, timeout=300, check=False)


def test_a_step_filters_normalises_and_leaves_readable_traces(tmp_path: Path) -> None:
    with (
        running_server(create_shop_app(ShopSettings(slots=16))) as shop,
        running_server(create_policy_app(PolicySettings(token_endpoint=True))) as model,
    ):
        done = _round(
            tmp_path, shop, model,
            "--over-sampling-batch-size", "8", "--rollout-batch-size", "8", "--n-samples-per-prompt", "3",
            "--out", str(tmp_path / "step.json"),
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    step = json.loads((tmp_path / "step.json").read_text())
    groups = {g["group_index"]: g for g in step["groups"]}
    assert sorted(groups) == list(range(8))
    for g in groups.values():
        # One rollout per slime sample (its index); siblings of a forked trajectory repeat it.
        assert sorted({s["rollout_id"] for s in g["samples"]}) == [g["group_index"] * 3 + i for i in range(3)]
        assert all(s["rollout_id"] == s["index"] for s in g["samples"])
        rewards = {s["rollout_id"]: s["reward"]["reward"] for s in g["samples"]}
        spread = max(rewards.values()) - min(rewards.values())
        # The filter's answer follows the group's rewards; a zero-spread group is kept only as a refill.
        assert g["reason"] == (None if spread > 1e-6 else "shopsim_zero_std_group")
        assert g["kept"] == (spread > 1e-6 or g["keep_when_insufficient"])
    assert sorted(step["kept_groups"]) == sorted(g for g, v in groups.items() if v["kept"])
    # The normaliser's advantages, recomputed by hand per group over unique rollouts.
    for g in step["kept_groups"]:
        rows = [a for a in step["advantages"] if a["group_index"] == g]
        per_rollout = {a["rollout_id"]: a["raw_reward"] for a in rows}
        expected = grpo_advantages_by_rollout(per_rollout)
        for a in rows:
            assert a["advantage"] == pytest.approx(expected[a["rollout_id"]], rel=1e-6, abs=1e-6)
    run = open_run(str(tmp_path / "runs/round-001"))
    episodes = {record.episode_id for record in run.records()}
    assert episodes == {s["episode_id"] for g in groups.values() for s in g["samples"]}
    assert "groups kept" in done.stdout
    metrics = step["metrics"]
    zero_spread_dropped = [g for g, v in groups.items() if v["reason"] == "shopsim_zero_std_group" and not v["kept"]]
    assert metrics["rollout/shopsim/group_count"] == 8 and metrics["rollout/shopsim/trajectory_count"] == 24
    assert metrics["rollout/shopsim/train_group_count"] == len(step["kept_groups"])
    assert metrics["rollout/shopsim/zero_std_group_drop_count"] == len(zero_spread_dropped)
    assert metrics["rollout/shopsim/technical_group_drop_count"] == 0 and metrics["rollout/shopsim/scored_rate"] == 1.0
    rewards = [s["reward"]["reward"] for g in groups.values() for s in {x["rollout_id"]: x for x in g["samples"]}.values()]
    assert metrics["rollout/shopsim/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))


def test_a_task_data_file_too_short_is_refused_by_name(tmp_path: Path) -> None:
    with (
        running_server(create_shop_app(ShopSettings(slots=4))) as shop,
        running_server(create_policy_app(PolicySettings(token_endpoint=True))) as model,
    ):
        done = _round(tmp_path, shop, model, "--over-sampling-batch-size", "9", "--out", str(tmp_path / "step.json"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "tasks.jsonl has 8 prompts; the round asks for 9" in done.stderr
    assert not (tmp_path / "step.json").exists()

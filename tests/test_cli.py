"""The command line: plan output and guards, exit codes, summarize on traces of the earlier format."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shopsimrl.planning import episode_seed

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shopsimrl", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def test_plan_val_lists_400_reference_seeded_episodes() -> None:
    first, second = cli("plan", "configs/qwen35_4b_val.yaml"), cli("plan", "configs/qwen35_4b_val.yaml")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["episodes"] == 400 and report["selected_tasks"] == 400 and report["persona"] is True
    assert report["task_split"]["task_ids_sha256"] == "103c72fd5da76870d2406420a8d7eab0c616780cb6fb8ac27875b5424dae872e"
    for job in report["first_jobs"]:
        assert job["seed"] == episode_seed(20260830, job["task_id"], 0)
        assert job["episode_id"] == f"task-{job['task_id']:06d}__sample-000"
    assert report["first_jobs"][0]["task_id"] == 19  # file order of the real val split
    assert json.loads(second.stdout)["plan_fingerprint"] == report["plan_fingerprint"]
    assert report["model"]["checkpoint_id"] == "qwen35-4b-base-hf" and "base_url" not in report["model"]


def test_test_split_guard(tmp_path: Path) -> None:
    refused = cli("plan", "configs/qwen35_4b_test.yaml")
    assert refused.returncode == 2 and "--final-test" in refused.stderr
    allowed = cli("plan", "configs/qwen35_4b_test.yaml", "--final-test")
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["test_guard"] == {"held_out_split": True, "final_test": True}
    bank = tmp_path / "bank.json"
    bank.write_text(json.dumps({"skills": [{"skill_id": "a", "content": "x"}]}), encoding="utf-8")
    config = (ROOT / "configs" / "qwen35_4b_test.yaml").read_text(encoding="utf-8")
    config = config.replace("splits/", str(ROOT / "configs" / "splits") + "/").replace("prompts/", str(ROOT / "configs" / "prompts") + "/")
    (tmp_path / "t.yaml").write_text(config.replace("path: null", f"path: {bank}"), encoding="utf-8")
    with_skills = cli("plan", str(tmp_path / "t.yaml"), "--final-test")
    assert with_skills.returncode == 2 and "skills.path: null" in with_skills.stderr
    wrong = cli("plan", "configs/qwen35_4b_val.yaml", "--final-test")
    assert wrong.returncode == 2


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    text = (ROOT / "configs" / "smoke.yaml").read_text(encoding="utf-8").replace("max_retries: 5", "max_retry: 5")
    (tmp_path / "bad.yaml").write_text(text, encoding="utf-8")
    result = cli("plan", str(tmp_path / "bad.yaml"))
    assert result.returncode == 2 and "model.max_retry: unknown key" in result.stderr


def test_summarize_traces_of_the_earlier_format(tmp_path: Path) -> None:
    run_dir = tmp_path / "legacy-run"
    run_dir.mkdir()
    shutil.copy(ROOT / "tests" / "fixtures" / "legacy_v4_traces.jsonl", run_dir / "traces.jsonl")
    result = cli("summarize", str(run_dir), "--requested", "6")
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["counts"]["requested"] == 6 and summary["counts"]["trace_files"] == 6
    assert summary["counts"]["completed"] == 4 and summary["counts"]["failed"] == 2
    assert summary["primary"]["reward_mean"] == pytest.approx(0.375)
    assert summary["behavior"]["termination_reasons"] == {"action_limit": 1, "generation_length": 1, "purchase": 2}
    assert "reward" in result.stdout


def test_summarize_missing_run_dir(tmp_path: Path) -> None:
    assert cli("summarize", str(tmp_path / "nope")).returncode == 2

"""Overrides and the time limit through the command line, as users run them (subprocesses, the
real testbed): plan shows and freezes them, a resume with another semantic override exits 42,
--run names a local run directory, sharded workers plan what the coordinator froze, and a slow
policy meets the time limit in every episode (issue 26, items 1 and 7)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testbed_process import ROOT, LocalTestbed, start_testbed, write_config

pytestmark = pytest.mark.slow


def shopsimrl(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shopsimrl", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout
    )


def manifest(location: Path) -> dict:
    return json.loads((location / "manifest.json").read_text(encoding="utf-8"))


def traces(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text(encoding="utf-8").splitlines() if line]


@pytest.fixture(scope="module")
def bed() -> Iterator[LocalTestbed]:
    with start_testbed() as testbed:
        yield testbed


def test_set_freezes_the_plan_the_same_yaml_edit_freezes(tmp_path: Path) -> None:
    base = write_config(tmp_path, name="ckpt", sample_size=4)
    text = base.read_text(encoding="utf-8")
    edited = tmp_path / "edited.yaml"
    edited.write_text(
        text.replace("max_retries: 6", "max_retries: 6\n  checkpoint_id: grpo-round-3\n  temperature: 0.7").replace(
            "max_steps: 30", "max_steps: 12"
        ),
        encoding="utf-8",
    )
    by_file = shopsimrl("plan", str(edited), "--shards", "2", "--run", str(tmp_path / "by-file"), "--json")
    flags = ("--checkpoint", "grpo-round-3", "--set", "model.temperature=0.7", "--set", "runtime.max_steps=12")
    by_flag = shopsimrl("plan", str(base), *flags, "--shards", "2", "--run", str(tmp_path / "by-flag"), "--json")
    assert by_file.returncode == 0 and by_flag.returncode == 0, by_file.stderr + by_flag.stderr
    file_manifest, flag_manifest = manifest(tmp_path / "by-file"), manifest(tmp_path / "by-flag")
    assert flag_manifest["plan_fingerprint"] == file_manifest["plan_fingerprint"]
    assert json.dumps(flag_manifest["plan"]).encode() == json.dumps(file_manifest["plan"]).encode()
    assert (tmp_path / "by-flag" / "jobs.jsonl").read_bytes() == (tmp_path / "by-file" / "jobs.jsonl").read_bytes()
    shard_maps = [json.loads((tmp_path / where / "shards.json").read_text()) for where in ("by-flag", "by-file")]
    for shard_map in shard_maps:  # when it was written, and the hash of the manifest (execution included)
        del shard_map["created_at"], shard_map["manifest_sha256"]
    assert shard_maps[0] == shard_maps[1]
    # Only the audit trail differs: where the run is and which values came from the command line.
    file_execution, flag_execution = file_manifest["execution"], flag_manifest["execution"]
    assert {k: v for k, v in flag_execution.items() if k not in ("overrides", "run")} == {
        k: v for k, v in file_execution.items() if k != "run"
    }
    assert "overrides" not in file_execution
    assert flag_execution["overrides"] == [
        {"key": "model.temperature", "value": 0.7, "from": "--set"},
        {"key": "runtime.max_steps", "value": 12, "from": "--set"},
        {"key": "model.checkpoint_id", "value": "grpo-round-3", "from": "--checkpoint"},
    ]
    report = json.loads(by_flag.stdout)
    assert report["plan_fingerprint"] == file_manifest["plan_fingerprint"] and report["overrides"] == flag_execution["overrides"]
    # A non-semantic override leaves the fingerprint alone.
    quiet = shopsimrl("plan", str(edited), "--set", "experiment.concurrency=64", "--set", "model.timeout=5", "--json")
    assert json.loads(quiet.stdout)["plan_fingerprint"] == file_manifest["plan_fingerprint"]

    table = shopsimrl("plan", str(base), *flags)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    start = lines.index("overrides")
    assert [line.split() for line in lines[start + 1 : start + 4]] == [
        ["model.temperature", "0.7", "(--set)"],
        ["runtime.max_steps", "12", "(--set)"],
        ["model.checkpoint_id", "grpo-round-3", "(--checkpoint)"],
    ]
    assert "overrides" in shopsimrl("plan", str(base)).stdout.splitlines()  # "none" when there are none


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("--set", "model.temperatur=0.5"), ["model.temperatur: unknown key", "[from --set model.temperatur]"]),
        (("--set", "runtime.max_model_seconds=-3"), ["runtime.max_model_seconds: Input should be greater than 0", "--set"]),
        (("--set", "model.api_key=sk-live-S3CRET"), ["--set model.api_key: refused", "model.api_key_env"]),
        (("--set", "noequals"), ["expected KEY=VALUE"]),
        (("--experiment", "a", "--set", "experiment.name=b"), ["experiment.name is set twice", "--experiment"]),
    ],
)
@pytest.mark.parametrize("command", ["plan", "run"])
def test_bad_overrides_exit_2_in_one_line(tmp_path: Path, command: str, args: tuple[str, ...], fragments: list[str]) -> None:
    from tests.test_cli import assert_one_line_bad_input, without

    config = write_config(tmp_path, name="bad", sample_size=2)
    result = subprocess.run(
        [sys.executable, "-m", "shopsimrl", command, str(config), *args],
        capture_output=True,
        text=True,
        env=without(),
        cwd=ROOT,
        timeout=120,
    )
    assert_one_line_bad_input(result, *fragments)
    assert "S3CRET" not in result.stdout + result.stderr
    assert not (tmp_path / "runs").exists()


def test_an_object_store_location_needs_shards(tmp_path: Path) -> None:
    from tests.test_cli import assert_one_line_bad_input, without

    config = write_config(tmp_path, name="s3", sample_size=2)
    result = subprocess.run(
        [sys.executable, "-m", "shopsimrl", "run", str(config), "--run", "s3://bucket/runs/x"],
        capture_output=True,
        text=True,
        env=without(),
        cwd=ROOT,
        timeout=120,
    )
    assert_one_line_bad_input(result, "--run s3://bucket/runs/x", "needs --shards N")


def test_a_local_run_with_overrides_resumes_and_refuses_another_checkpoint(tmp_path: Path, bed: LocalTestbed) -> None:
    config = write_config(tmp_path, name="ckpt", sample_size=3)
    run_dir = tmp_path / "elsewhere" / "round-1"
    flags = ("--run", str(run_dir), "--checkpoint", "round-1", "--set", "model.temperature=0.0", "--no-progress")
    first = shopsimrl("run", str(config), *flags, env=bed.env())
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (tmp_path / "runs").exists()  # the run went where --run said
    assert len(traces(run_dir)) == 3 and json.loads((run_dir / "summary.json").read_text())["counts"]["completed"] == 3
    frozen = manifest(run_dir)
    assert frozen["plan"]["model"]["checkpoint_id"] == "round-1"
    assert {"key": "model.checkpoint_id", "value": "round-1", "from": "--checkpoint"} in frozen["execution"]["overrides"]
    assert {"key": "model.base_url", "value": bed.model_url, "from": "SHOPSIMRL_MODEL_BASE_URL"} in frozen["execution"][
        "overrides"
    ]
    status = shopsimrl("status", str(run_dir))
    assert status.returncode == 0, status.stderr

    # Execution-only changes resume: nothing runs again.
    again = shopsimrl("run", str(config), *flags, "--concurrency", "1", "--set", "model.timeout=9", env=bed.env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 to run" in again.stderr and len(traces(run_dir)) == 3

    # The same edit made in the YAML is the same plan: it resumes too.
    edited = tmp_path / "edited.yaml"
    edited.write_text(
        config.read_text(encoding="utf-8").replace("max_retries: 6", "max_retries: 6\n  checkpoint_id: round-1"), encoding="utf-8"
    )
    by_file = shopsimrl("run", str(edited), "--run", str(run_dir), "--no-progress", env=bed.env())
    assert by_file.returncode == 0 and "0 to run" in by_file.stderr, by_file.stderr[-3000:]

    # Another checkpoint in the same run directory is another plan: exit 42, as a YAML edit would.
    other = shopsimrl("run", str(config), "--run", str(run_dir), "--checkpoint", "round-2", "--no-progress", env=bed.env())
    assert other.returncode == 42, other.stderr[-3000:]
    assert "model.checkpoint_id: 'round-1' -> 'round-2'" in other.stderr
    edited.write_text(edited.read_text(encoding="utf-8").replace("round-1", "round-2"), encoding="utf-8")
    assert shopsimrl("run", str(edited), "--run", str(run_dir), "--no-progress", env=bed.env()).returncode == 42
    assert len(traces(run_dir)) == 3


def test_sharded_workers_plan_with_the_coordinators_overrides(tmp_path: Path, bed: LocalTestbed) -> None:
    config = write_config(tmp_path, name="sharded", sample_size=2)
    location = tmp_path / "sharded-run"
    result = shopsimrl(
        "run",
        str(config),
        "--shards",
        "2",
        "--run",
        str(location),
        "--checkpoint",
        "0123",  # text: read as YAML by a worker it would be the number 123, another plan (exit 42)
        "--set",
        "tasks.sample_size=3",
        "--concurrency",
        "2",
        "--no-progress",
        env=bed.env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((location / "summary.json").read_text(encoding="utf-8"))
    assert summary["counts"]["completed"] == 3 and summary["counts"]["requested"] == 3
    assert manifest(location)["plan"]["model"]["checkpoint_id"] == "0123"
    assert summary["run"]["checkpoint_id"] == "0123"


def test_a_slow_policy_meets_the_time_limit_in_every_episode(tmp_path: Path) -> None:
    # Each reply takes at least 300 ms (the policy answers no sooner), the limit is 250 ms of model
    # time: whatever the machine's load, the first reply crosses it, so every episode is ended
    # after exactly one step (the first page offers only search: no episode can be done by then).
    with start_testbed(SHOPSIM_POLICY_LATENCY_MS="300") as slow:
        config = write_config(tmp_path, name="timed", sample_size=3)
        result = shopsimrl("run", str(config), "--set", "runtime.max_model_seconds=0.25", "--no-progress", env=slow.env())
        assert result.returncode == 0, result.stderr[-3000:]
        health = slow.healthz()
        assert health["free_slots"] == health["environment_slots"]
    run_dir = tmp_path / "runs" / "timed"
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["counts"]["completed"] == 3 and summary["counts"]["scored"] == 3
    assert summary["behavior"]["termination_reasons"] == {"time_limit": 3}
    assert "time_limit 3" in result.stdout
    assert manifest(run_dir)["plan"]["runtime"]["max_model_seconds"] == 0.25
    for trace in traces(run_dir):
        (step,) = trace["steps"]
        limit = trace["time_limit"]
        assert limit["max_model_seconds"] == 0.25 and limit["model_steps"] == 1 and limit["sent_as"] == "action_limit"
        assert limit["model_seconds"] == round(step["model"]["latency_ms"] / 1000.0, 6) >= 0.3
        assert trace["final"]["termination_reason"] == "action_limit" and trace["final"]["reward"] == 0.0
        assert step["action"].startswith("search[") and trace["provenance"]["runtime"]["max_model_seconds"] == 0.25

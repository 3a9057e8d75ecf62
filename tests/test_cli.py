"""The command line: plan output and guards, exit codes, summarize on traces of the earlier format."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shopsimrl.planning import episode_seed

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shopsimrl", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def test_plan_val_lists_400_reference_seeded_episodes() -> None:
    first, second = cli("plan", "configs/qwen35_4b_val.yaml", "--json"), cli("plan", "configs/qwen35_4b_val.yaml", "--json")
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
    allowed = cli("plan", "configs/qwen35_4b_test.yaml", "--final-test", "--json")
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["test_guard"] == {"held_out_split": True, "final_test": True}
    bank = tmp_path / "bank.json"
    bank.write_text(json.dumps({"skills": [{"skill_id": "a", "content": "x"}]}), encoding="utf-8")
    config = (ROOT / "configs" / "qwen35_4b_test.yaml").read_text(encoding="utf-8")
    config = config.replace("splits/", str(ROOT / "configs" / "splits") + "/").replace(
        "prompts/", str(ROOT / "configs" / "prompts") + "/"
    )
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


# --------------------------------------------------------------------------- bad input and secrets (issue 10)

SPLIT_FILE = ROOT / "configs" / "splits" / "persona_splits.v1.json"
PASSWORD = "t0p-s3cret-pw"


def small_config(directory: Path, *, experiment: str = "name: bad-input", model_url: str = "http://127.0.0.1:1/v1") -> Path:
    path = directory / "bad-input.yaml"
    path.write_text(
        f"experiment: {{output_dir: {directory / 'runs'}, {experiment}}}\n"
        f"tasks: {{split_file: {SPLIT_FILE}, split: val, sample_size: 2}}\n"
        f"model: {{name: m, base_url: '{model_url}', api_key_env: null}}\n",
        encoding="utf-8",
    )
    return path


def assert_one_line_bad_input(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """Exit 2 with exactly one ``error:`` line that says what is wrong; never a traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def without(env_keys: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOPSIMRL_") and k not in env_keys}
    return {**env, **extra}


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nothing can be created in, for whoever runs the tests."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        yield locked
        locked.chmod(0o755)
    elif Path("/sys/kernel").is_dir():
        yield Path("/sys")  # sysfs refuses mkdir even to root (EPERM)
    else:
        pytest.skip("running as root without sysfs: no directory is unwritable")


@pytest.mark.parametrize(
    ("location", "fragments"),
    [
        ("s3://", ["needs a bucket"]),
        ("s3:/bucket/x", ["'s3:' without '//'"]),
        ("gopher://host/x", ["unsupported run location scheme 'gopher://'"]),
        ("http://127.0.0.1:1/runs/x", ["unsupported run location scheme 'http://'"]),
        ("s3://bucket/x?versionId=1", ["takes no ?query"]),
        ("FILE", ["exists and is not a directory"]),
        ("FILE/sub", ["cannot be a directory, because"]),
        ("UNWRITABLE/run", ["access denied", "permissions"]),
    ],
)
def test_bad_run_locations_exit_2_in_one_line(tmp_path: Path, unwritable_dir: Path, location: str, fragments: list[str]) -> None:
    config = small_config(tmp_path)
    location = location.replace("FILE", str(config)).replace("UNWRITABLE", str(unwritable_dir))
    work = tmp_path / "cwd"
    work.mkdir()
    result = cli("plan", str(config), "--shards", "2", "--run", location, cwd=work, env=without())
    assert_one_line_bad_input(result, *fragments)
    assert list(work.iterdir()) == []  # nothing written into a directory named after the URI


def test_unsupported_location_in_status_exits_2(tmp_path: Path) -> None:
    assert_one_line_bad_input(cli("status", "gopher://host/x", cwd=tmp_path, env=without()), "unsupported run location scheme")


@pytest.mark.parametrize(
    "location",
    [f"s3://AKIAEXAMPLE:{PASSWORD}@bucket/x", f"file://user:{PASSWORD}@/ABS", f"s3://AKIAEXAMPLE:{PASSWORD}/x@bucket/x"],
)
@pytest.mark.parametrize("command", ["plan", "status"])
def test_credentials_in_a_run_uri_are_refused_and_never_printed(tmp_path: Path, location: str, command: str) -> None:
    location = location.replace("/ABS", str(tmp_path / "abs"))
    work = tmp_path / "cwd"
    work.mkdir()
    args = (
        ("plan", str(small_config(tmp_path)), "--shards", "2", "--run", location) if command == "plan" else ("status", location)
    )
    result = cli(*args, cwd=work, env=without(AWS_ENDPOINT_URL="http://127.0.0.1:1"))
    assert_one_line_bad_input(result)
    assert PASSWORD not in result.stdout + result.stderr
    assert list(work.iterdir()) == [] and not (tmp_path / "abs").exists()


@pytest.mark.parametrize(
    ("variable", "url"),
    [
        ("SHOPSIMRL_MODEL_BASE_URL", f"http://alice:{PASSWORD}@127.0.0.1:1/v1"),
        ("SHOPSIMRL_ENV_BASE_URL", f"http://alice:{PASSWORD}@127.0.0.1:1"),
    ],
)
def test_credentials_in_service_url_overrides_exit_2(tmp_path: Path, variable: str, url: str) -> None:
    result = cli("plan", str(small_config(tmp_path)), cwd=tmp_path, env=without(**{variable: url}))
    assert_one_line_bad_input(result, variable, "must not contain user:password@ credentials")
    assert PASSWORD not in result.stdout + result.stderr
    if variable == "SHOPSIMRL_MODEL_BASE_URL":
        assert "model.api_key_env" in result.stderr


@pytest.mark.parametrize("command", [("env", "slots", "--url"), ("status", "RUN", "--env-url")])
def test_credentials_in_operator_shop_urls_exit_2(tmp_path: Path, command: tuple[str, ...]) -> None:
    args = [str(tmp_path) if part == "RUN" else part for part in command]
    result = cli(*args, f"http://alice:{PASSWORD}@127.0.0.1:1", cwd=tmp_path, env=without())
    assert_one_line_bad_input(result, f"{command[-1]}: must not contain user:password@ credentials")
    assert PASSWORD not in result.stdout + result.stderr


def test_credentials_in_model_base_url_exit_2(tmp_path: Path) -> None:
    config = small_config(tmp_path, model_url=f"http://alice:{PASSWORD}@127.0.0.1:1/v1")
    result = cli("plan", str(config), cwd=tmp_path, env=without())
    assert_one_line_bad_input(result, "model.base_url: must not contain user:password@ credentials", "model.api_key_env")
    assert PASSWORD not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("experiment", "fragments"),
    [
        ("name: '///'", ["experiment.name '///' has no usable characters"]),
        ("seed: -5", ["experiment.seed: Input should be greater than or equal to 0"]),
        ("seed: true", ["experiment.seed: Input should be a valid integer"]),
    ],
)
def test_bad_experiment_values_exit_2(tmp_path: Path, experiment: str, fragments: list[str]) -> None:
    config = small_config(tmp_path, experiment=experiment)
    assert_one_line_bad_input(cli("plan", str(config), cwd=tmp_path, env=without()), *fragments)


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("SHOPSIMRL_FLUSH_SECONDS", "inf", "SHOPSIMRL_FLUSH_SECONDS: Input should be a finite number"),
        ("SHOPSIMRL_STORE_RETRY_BUDGET_S", "-1", "SHOPSIMRL_STORE_RETRY_BUDGET_S must be a finite number of seconds >= 0"),
        ("SHOPSIMRL_STORE_RETRY_BUDGET_S", "nan", "SHOPSIMRL_STORE_RETRY_BUDGET_S must be a finite number of seconds >= 0"),
    ],
)
def test_non_finite_or_negative_budgets_exit_2(tmp_path: Path, variable: str, value: str, fragment: str) -> None:
    config = small_config(tmp_path)
    result = cli(
        "plan", str(config), "--shards", "1", "--run", str(tmp_path / "run"), cwd=tmp_path, env=without(**{variable: value})
    )
    assert_one_line_bad_input(result, fragment)


def test_unwritable_output_dir_of_a_local_run_exits_2(tmp_path: Path, unwritable_dir: Path) -> None:
    config = small_config(tmp_path)
    config.write_text(config.read_text(encoding="utf-8").replace(str(tmp_path / "runs"), str(unwritable_dir)), encoding="utf-8")
    result = cli("run", str(config), "--no-progress", cwd=tmp_path, env=without())
    assert_one_line_bad_input(result, "experiment.output_dir: cannot create the run directory", str(unwritable_dir / "bad-input"))

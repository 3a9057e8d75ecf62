"""The tracking settings and what is logged, without a tracker's server: the ``tracking:`` block's
checks, that it changes no fingerprint, the redaction of what leaves, the summary's headline and
the tables, and a tracker that is not installed (reported, never raised)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shopsimrl.cli.common import tracking_settings
from shopsimrl.cli.errors import BadInputError
from shopsimrl.config import ConfigError, ConfigOverride, load_experiment_config
from shopsimrl.research.tracking import Redactor, TrackedRun, Tracking
from shopsimrl.research.tracking.evaluation import category_rows, episode_rows, headline_scalars
from shopsimrl.runner.experiment import prepare
from shopsimrl.schemas import fingerprint

REPO = Path(__file__).resolve().parents[2]
SPLITS = REPO / "configs" / "splits" / "persona_splits.v1.json"


def _config(tmp_path: Path, tracking: str = "") -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(
        f"experiment: {{name: exp, output_dir: {tmp_path / 'runs'}}}\n"
        f"tasks: {{split_file: {SPLITS}, split: val, sample_size: 3}}\n"
        "model: {name: m, base_url: 'http://127.0.0.1:1/v1', api_key_env: null}\n" + tracking,
        encoding="utf-8",
    )
    return path


@pytest.mark.parametrize(
    ("block", "fragments"),
    [
        ("tracking: {backends: [neptune]}", ["tracking.backends.0", "'wandb' or 'mlflow'"]),
        ("tracking: {projekt: x}", ["tracking.projekt: unknown key"]),
        ("tracking: {project: 'team/x'}", ["tracking.project", "without /"]),
        ("tracking: {tags: ['']}", ["tracking.tags", "1 to 64 characters"]),
        ("tracking: {mode: shared}", ["tracking.mode"]),
        ("tracking: {timeout_seconds: 0}", ["tracking.timeout_seconds"]),
    ],
)
def test_a_bad_tracking_block_names_its_key(tmp_path: Path, block: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as raised:
        load_experiment_config(_config(tmp_path, block + "\n"), load_dotenv=False)
    assert all(fragment in str(raised.value) for fragment in fragments), str(raised.value)


@pytest.mark.parametrize("uri", ["https://alice:hunter2-pw@mlflow.example:5000", "https://mlflow.example/?token=hunter2-pw"])
def test_credentials_in_the_tracking_uri_are_refused_and_never_echoed(tmp_path: Path, uri: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_experiment_config(_config(tmp_path, f"tracking: {{tracking_uri: '{uri}'}}\n"), load_dotenv=False)
    message = str(raised.value)
    assert "tracking.tracking_uri" in message and "MLFLOW_TRACKING" in message and "hunter2" not in message


def test_the_tracking_block_changes_no_fingerprint(tmp_path: Path) -> None:
    bare = load_experiment_config(_config(tmp_path), load_dotenv=False)
    tracked = load_experiment_config(
        _config(tmp_path, "tracking: {backends: [wandb, mlflow], project: p, tags: [a], mode: offline}\n"),
        load_dotenv=False,
        overrides=[ConfigOverride("tracking.project", "other", "--set")],
    )
    assert tracked.tracking is not None and tracked.tracking.project == "other"
    assert fingerprint(prepare(bare).plan()) == fingerprint(prepare(tracked).plan())


def test_track_adds_to_the_block_and_its_dir_is_relative_to_the_yaml(tmp_path: Path) -> None:
    config = load_experiment_config(_config(tmp_path, "tracking: {backends: [mlflow], dir: out/wb}\n"), load_dotenv=False)
    settings = tracking_settings(["wandb", "mlflow"], config)
    assert settings is not None and settings.backends == ["mlflow", "wandb"]
    assert settings.dir == str(tmp_path / "out" / "wb")
    assert tracking_settings(None, load_experiment_config(_config(tmp_path), load_dotenv=False)) is None
    with pytest.raises(BadInputError, match="--track neptune: unknown tracker"):
        tracking_settings(["neptune"])


def test_a_tracker_not_installed_is_said_before_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    settings = tracking_settings(["wandb", "mlflow"])
    assert settings is not None and settings.backends == ["wandb", "mlflow"]  # the run goes on, tracked where it can be
    err = capsys.readouterr().err
    assert "warning: wandb not installed" in err and "shopsimrl[tracking]" in err and "mlflow" not in err


def test_the_redactor_removes_url_credentials_and_secret_environment_values() -> None:
    redact = Redactor(
        {"OPENAI_API_KEY": "sk-abcdef123456", "WANDB_API_KEY": "0123456789abcdef", "SHORT_TOKEN": "abc", "HOME": "/home/me"}
    )
    text = "post https://bob:pw@gw.example/v1?api-key=zz9&x=1 failed; key sk-abcdef123456 in /home/me"
    assert redact.text(text) == "post https://gw.example/v1?api-key=REDACTED&x=1 failed; key REDACTED in /home/me"
    assert redact.value({"url": "http://u:p@h/", "n": [1, "0123456789abcdef"]}) == {"url": "http://h/", "n": [1, "REDACTED"]}
    assert redact.data(b"\xff\xfe binary") == b"\xff\xfe binary"
    assert redact.text("abc is too short to be masked") == "abc is too short to be masked"


def test_the_headline_and_the_tables() -> None:
    summary = {
        "counts": {"requested": 4, "completed": 3, "failed": 1, "missing": 0, "coverage": 0.75},
        "intent_to_treat": {
            "score": 37.5, "reward_mean": 0.375, "reward_ci95": [0.1, 0.6], "success_rate": 0.25,
            "success_ci95": [0.0, 0.7], "episodes": 4, "failed_counted_as_zero": 1, "failed_infrastructure_excluded": 0,
        },
        "cost": {"tokens": {"total_tokens": 1000}, "money": {"total": 0.5, "currency": "USD"}, "accelerator_hours": None},
        "failure_classes": {"policy": 1},
        "per_task": {"pass_at_k": {"1": 0.25}},
    }  # fmt: skip
    scalars = headline_scalars(summary)
    assert scalars["itt/score"] == 37.5 and scalars["itt/reward_ci95_low"] == 0.1 and scalars["itt/reward_ci95_high"] == 0.6
    assert scalars["counts/coverage"] == 0.75 and scalars["tokens/total_tokens"] == 1000 and scalars["cost/money_total"] == 0.5
    assert scalars["failures/policy"] == 1 and scalars["pass_at_k/1"] == 0.25 and scalars["cost/accelerator_hours"] is None
    rows = {
        "a": {"completed": True, "category": "鞋", "reward": 1.0, "reward_itt": 1.0, "success_itt": 1.0, "total_tokens": 10},
        "b": {"completed": True, "category": "鞋", "reward": 0.5, "reward_itt": 0.5, "success_itt": 0.0, "total_tokens": 20},
        "c": {"completed": False, "category": None, "reward": None, "reward_itt": 0.0, "success_itt": 0.0, "total_tokens": 5},
    }
    assert category_rows(rows) == [["鞋", 2, 2, 0, 0.75, 0.5, 0.75, 30], ["unknown", 1, 0, 1, 0.0, 0.0, None, 5]]
    table = episode_rows(rows, {"a": (7, 0, 1, "val"), "b": (8, 0, 2, "val"), "d": (9, 0, 3, "val")})
    assert [(row[0], row[1], row[4]) for row in table] == [
        ("a", 7, "completed"),
        ("b", 8, "completed"),
        ("d", 9, "missing"),
        ("c", None, "failed"),
    ]


@pytest.mark.parametrize("module", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_is_reported_not_raised(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import wandb` now raises ImportError, as without the package
    from shopsimrl.config import TrackingSection

    settings = TrackingSection(backends=[module])  # type: ignore[list-item]
    with Tracking(settings, TrackedRun("r", "evaluation", {})) as tracked:
        tracked.log_scalars({"x": 1.0})
        tracked.log_table("t", ["a"], [[1]])
        tracked.log_files("f", "k", {"a.txt": b"x"})
        assert not tracked.active
    (outcome,) = tracked.outcomes
    assert not outcome.ok and outcome.error is not None
    assert f"{module} is not installed" in outcome.error and "shopsimrl[tracking]" in outcome.error
    assert "results are unaffected" in outcome.line()

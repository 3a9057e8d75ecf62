"""Experiment trackers for real: W&B in offline mode into a temporary folder, read back from the
files it writes, and MLflow against a real tracking server (sqlite store) started here, read back
with ``MlflowClient``. Runs are made by the real CLI against the real testbed; every failure
(network, authentication, a server dying mid-way) is forced and shown not to change an exit code
or leak a secret."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.config import TrackingSection
from shopsimrl.research.tracking import TrackedRun, Tracking
from shopsimrl.research.tracking.evaluation import CATEGORY_COLUMNS, EPISODE_COLUMNS
from shopsimrl.storage.reading import open_run
from shopsimrl.testbed.serving import free_port
from tests.research.test_gate_earlier import earlier  # noqa: F401 - the fixture, used by name below
from tests.research.trackers import (
    MlflowServer,
    files_holding,
    mlflow_artifact,
    mlflow_runs,
    offline_runs,
    read_wandb_run,
    start_mlflow_server,
    wandb_environment,
)
from tests.sharded.conftest import cli, write_config
from tests.testbed_process import LocalTestbed

from .conftest import ResearchRuns

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
QUERY_SECRET = "qs-7f3e9c1d5b2a4e6f8a0c"
KEY_SECRET = "sk-live-4b8d2f6a1c3e5g7h9j0k"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    with start_mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.fixture
def wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B's directories for this test (in this process too), nothing from the caller's environment."""
    home = tmp_path / "wandb-home"
    for key, value in wandb_environment(home).items():
        if key.startswith("WANDB_"):
            monkeypatch.setenv(key, value)
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_BASE_URL", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    return home


def _rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    return [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]


def test_a_run_lands_in_wandb_offline_and_mlflow(
    tmp_path: Path, testbed: LocalTestbed, mlflow_server: MlflowServer, wandb_home: Path
) -> None:
    config = write_config(tmp_path, testbed, episodes=6, name="tracked")
    wandb_dir = tmp_path / "wandb-runs"
    # The tracking: block opts into W&B; --track adds MLflow, whose server the block names.
    config.write_text(
        config.read_text(encoding="utf-8")
        + f"tracking:\n  backends: [wandb]\n  mode: offline\n  dir: {wandb_dir}\n  project: shopsimrl-tests\n"
        f"  tags: [ci, sweep]\n  tracking_uri: {mlflow_server.uri}\n",
        encoding="utf-8",
    )
    env = {**wandb_environment(wandb_home), "SHOPSIM_TEST_API_KEY": KEY_SECRET}
    result = cli(
        "run", str(config), "--no-progress", "--track", "mlflow",
        # Secrets on the command line and in the environment: a query token in the model URL, a key.
        "--set", f"model.base_url={testbed.model_url}?api-key={QUERY_SECRET}",
        "--set", "model.api_key_env=SHOPSIM_TEST_API_KEY",
        env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tracked in wandb: W&B offline run" in result.stderr and "tracked in mlflow: MLflow run" in result.stderr
    run_dir = tmp_path / "local-runs" / "tracked"
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    itt, identity = summary["intent_to_treat"], summary["run"]
    traces = {record.episode_id: record for record in open_run(str(run_dir)).records()}
    assert len(traces) == 6

    (wandb_run_dir,) = offline_runs(wandb_dir)
    wb = read_wandb_run(wandb_run_dir)
    assert (wb.project, wb.name, wb.job_type, wb.exit_code) == ("shopsimrl-tests", "tracked", "evaluation", 0)
    assert set(wb.tags) == {"ci", "sweep", "evaluation"}
    logged = wb.config["shopsimrl"]
    for key in ("experiment", "model_name", "checkpoint_id", "plan_fingerprint", "split"):
        assert logged[key] == identity[key], key
    assert logged["split"]["name"] == "val" and logged["plan_fingerprint"]
    assert wb.summary["itt/score"] == pytest.approx(itt["score"])
    assert [wb.summary["itt/reward_ci95_low"], wb.summary["itt/reward_ci95_high"]] == pytest.approx(itt["reward_ci95"])
    assert wb.summary["itt/success_rate"] == pytest.approx(itt["success_rate"])
    assert wb.summary["counts/coverage"] == 1.0 and wb.summary["counts/failed"] == 0
    assert wb.summary["tokens/total_tokens"] == summary["cost"]["tokens"]["total_tokens"] > 0
    assert wb.summary["tracking/episode_rows"] == 6

    episodes = wb.table("episodes")
    assert episodes["columns"] == list(EPISODE_COLUMNS)
    rows = _rows(episodes)
    assert {row["episode_id"] for row in rows} == set(traces)
    for row in rows:
        record = traces[row["episode_id"]]
        assert row["status"] == "completed" and row["task_id"] == record.job.task_id
        assert row["reward"] == pytest.approx(record.final.reward) and row["steps"] == len(record.steps)
    assert sum(row["reward_itt"] for row in rows) / 6 == pytest.approx(itt["reward_mean"])
    categories = wb.table("categories")
    assert categories["columns"] == list(CATEGORY_COLUMNS) and sum(row["episodes"] for row in _rows(categories)) == 6

    files = wb.artifact_files("shopsimrl-evaluation")
    assert set(files) == {"summary.json", "summary.txt", "report.html"}
    assert json.loads(files["summary.json"]) == summary
    assert "reward (ITT)" in files["summary.txt"].decode() and files["report.html"].startswith(b"<!DOCTYPE html>")

    (ml,) = mlflow_runs(mlflow_server.uri, "shopsimrl-tests")
    assert (ml.info.status, ml.info.run_name) == ("FINISHED", "tracked")
    assert ml.data.metrics["itt/score"] == pytest.approx(itt["score"])
    assert ml.data.metrics["itt/reward_ci95_low"] == pytest.approx(itt["reward_ci95"][0])
    assert ml.data.params["plan_fingerprint"] == identity["plan_fingerprint"] and ml.data.params["split.name"] == "val"
    tags = ml.data.tags
    assert tags["shopsimrl.fingerprint"] == identity["plan_fingerprint"] and tags["shopsimrl.experiment"] == "tracked"
    assert tags["ci"] == tags["sweep"] == "true" and tags["shopsimrl.kind"] == "evaluation"
    downloads = tmp_path / "downloads"
    table = json.loads(mlflow_artifact(mlflow_server.uri, ml.info.run_id, "tables/episodes.json", downloads))
    assert table["columns"] == list(EPISODE_COLUMNS) and len(table["data"]) == 6
    assert json.loads(mlflow_artifact(mlflow_server.uri, ml.info.run_id, "tracked-evaluation/summary.json", downloads)) == summary

    # Nothing secret reached either tracker's store (W&B would keep the command line as metadata).
    for root in (wandb_dir, wandb_home, mlflow_server.store.parent):
        assert files_holding(root, QUERY_SECRET, KEY_SECRET) == []


def test_a_sharded_run_is_tracked_after_its_reduce_and_settings_come_from_the_trackers_variables(
    tmp_path: Path, testbed: LocalTestbed, mlflow_server: MlflowServer, wandb_home: Path
) -> None:
    config = write_config(tmp_path, testbed, episodes=4, name="sharded-tracked")
    wandb_dir = tmp_path / "wandb-runs"
    wandb_dir.mkdir()
    env = {
        **wandb_environment(wandb_home),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(wandb_dir),
        "WANDB_PROJECT": "sharded-tests",
        "MLFLOW_TRACKING_URI": mlflow_server.uri,
        "MLFLOW_EXPERIMENT_NAME": "sharded-tests",
    }
    run_dir = tmp_path / "sharded"
    result = cli("run", str(config), "--shards", "2", "--run", str(run_dir), "--no-progress", "--track", "wandb", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    (wandb_run_dir,) = offline_runs(wandb_dir)
    wb = read_wandb_run(wandb_run_dir)
    assert wb.project == "sharded-tests" and wb.config["shopsimrl"]["uri"] == summary["run"]["uri"]
    assert wb.summary["itt/score"] == pytest.approx(summary["intent_to_treat"]["score"])
    assert {row["episode_id"] for row in _rows(wb.table("episodes"))} == {r.episode_id for r in open_run(str(run_dir)).records()}

    # Later, from elsewhere: reduce again into MLflow (the experiment from MLFLOW_EXPERIMENT_NAME).
    again = cli("reduce", str(run_dir), "--track", "mlflow", env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    (ml,) = mlflow_runs(mlflow_server.uri, "sharded-tests")
    assert ml.data.metrics["counts/requested"] == 4 and ml.data.metrics["tracking/episode_rows"] == 4
    assert ml.data.params["experiment"] == "sharded-tracked"


def _dead_config(directory: Path) -> Path:
    """Two episodes against a model and a shop that are not there: both fail (exit 1), fast."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "dead.yaml"
    path.write_text(
        f"experiment: {{name: dead, output_dir: {directory / 'runs'}}}\n"
        f"tasks: {{split_file: {REPO / 'configs/splits/persona_splits.v1.json'}, split: val, sample_size: 2}}\n"
        "environment: {base_url: 'http://127.0.0.1:1', max_retries: 1, reset_timeout: 2}\n"
        "runtime: {max_episode_retries: 0}\n"
        "model: {name: m, base_url: 'http://127.0.0.1:1/v1', api_key_env: null, max_retries: 1}\n",
        encoding="utf-8",
    )
    return path


def _counts(path: Path) -> dict[str, Any]:
    summary = json.loads(path.read_text(encoding="utf-8"))
    return {key: summary[key] for key in ("counts", "intent_to_treat", "failure_classes", "errors")}


def test_failing_trackers_change_neither_the_exit_code_nor_the_summary(tmp_path: Path, wandb_home: Path) -> None:
    closed = free_port()  # nothing listens there
    env = {
        **wandb_environment(wandb_home),
        "WANDB_MODE": "online",  # and no API key: W&B refuses at once
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{closed}",
    }
    plain = cli("run", str(_dead_config(tmp_path / "plain")), "--no-progress", env=env)
    tracked = cli(
        "run", str(_dead_config(tmp_path / "tracked")), "--no-progress", "--track", "wandb", "--track", "mlflow", env=env
    )
    assert plain.returncode == tracked.returncode == 1, tracked.stderr[-3000:]
    assert _counts(tmp_path / "plain/runs/dead/summary.json") == _counts(tmp_path / "tracked/runs/dead/summary.json")
    assert tracked.stderr.count("tracker_failed") == 2 and "tracked in" not in tracked.stderr
    assert "no W&B API key" in tracked.stderr and "Connection refused" in tracked.stderr

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "traces.jsonl").write_bytes((REPO / "tests/fixtures/legacy_v4_traces.jsonl").read_bytes())
    summarized = cli("summarize", str(legacy), "--requested", "6", "--track", "mlflow", env=env)
    assert summarized.returncode == 0 and "tracker_failed" in summarized.stderr
    assert "reward" in summarized.stdout and (legacy / "summary.json").is_file()
    unknown = cli("summarize", str(legacy), "--track", "neptune", env=env)
    assert unknown.returncode == 2 and "--track neptune: unknown tracker; choose from wandb, mlflow" in unknown.stderr


class _Refusing(BaseHTTPRequestHandler):
    """Every request refused as unauthenticated; the Authorization headers seen are kept."""

    seen: list[str]

    def _refuse(self) -> None:
        self.seen.append(self.headers.get("Authorization") or "")
        body = b'{"error_code": "UNAUTHENTICATED", "message": "bad credentials", "errors": [{"message": "bad credentials"}]}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _refuse

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        pass


def test_refused_credentials_are_reported_without_the_key(
    tmp_path: Path, wandb_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    handler = type("Refusing", (_Refusing,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    wandb_key, mlflow_token = "0123456789abcdef0123456789abcdef01234567", "mlflow-token-5e2c8a1f"
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.setenv("WANDB_API_KEY", wandb_key)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", mlflow_token)
    settings = TrackingSection(backends=["wandb", "mlflow"], mode="online", tracking_uri=url, timeout_seconds=20)
    try:
        with Tracking(settings, TrackedRun("refused", "evaluation", {"experiment": "refused"})) as tracked:
            tracked.log_scalars({"itt/score": 1.0})
    finally:
        server.shutdown()
    assert [(o.tracker, o.ok) for o in tracked.outcomes] == [("wandb", False), ("mlflow", False)]
    # The servers were asked with the credentials and refused them: the failure is the authentication.
    assert f"Bearer {mlflow_token}" in handler.seen
    assert f"Basic {base64.b64encode(f'api:{wandb_key}'.encode()).decode()}" in handler.seen
    shown = " ".join(str(o.error) for o in tracked.outcomes) + capsys.readouterr().err
    assert "start failed" in shown and wandb_key not in shown and mlflow_token not in shown


def test_a_tracker_failing_midway_ends_alone(tmp_path: Path, wandb_home: Path) -> None:
    import wandb

    wandb_dir = tmp_path / "wandb-runs"
    with start_mlflow_server(tmp_path / "mlflow") as server:
        settings = TrackingSection(backends=["wandb", "mlflow"], mode="offline", dir=str(wandb_dir), tracking_uri=server.uri)
        with Tracking(settings, TrackedRun("midway", "evaluation", {"experiment": "midway"})) as tracked:
            assert tracked.active
            server.stop()  # the MLflow server goes after the run started on it
            tracked.log_scalars({"itt/score": 50.0})
            tracked.log_table("episodes", ["episode_id", "reward"], [["e1", 0.5], ["e2", None]])
    # A finished run's file is closed by W&B's service process after finish() returns; a command
    # ends its process (wandb's exit hook waits for that), here the service is stopped to wait.
    wandb.teardown()
    wandb_outcome, mlflow_outcome = tracked.outcomes
    assert wandb_outcome.ok and not mlflow_outcome.ok
    assert mlflow_outcome.error is not None and mlflow_outcome.error.startswith("log scalars failed")
    wb = read_wandb_run(offline_runs(wandb_dir)[0])
    assert wb.summary["itt/score"] == 50.0 and wb.table("episodes")["data"] == [["e1", 0.5], ["e2", None]]


def test_gate_fit_tracks_its_contributions(
    tmp_path: Path, request: pytest.FixtureRequest, wandb_home: Path, mlflow_server: MlflowServer
) -> None:
    gate = request.getfixturevalue("earlier")
    env = {
        **wandb_environment(wandb_home),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "MLFLOW_TRACKING_URI": mlflow_server.uri,
        "MLFLOW_EXPERIMENT_NAME": "gates",
    }
    fitted = cli("gate", "fit", str(gate["gate_yaml"]), "--track", "wandb", "--track", "mlflow", env=env)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    document = json.loads((gate["gate_dir"] / "refit" / "contributions.json").read_text(encoding="utf-8"))
    wb = read_wandb_run(offline_runs(tmp_path)[0])
    assert wb.job_type == "gate" and wb.summary["gate/selected_chunks"] == len(document["selected_chunk_ids"]) == 1
    rows = {row["chunk"]: row for row in _rows(wb.table("contributions"))}
    assert rows["options"]["coefficient"] == pytest.approx(0.25) and rows["options"]["status"] == "selected"
    assert "contributions.json" in wb.artifact_files("shopsimrl-gate")
    (ml,) = mlflow_runs(mlflow_server.uri, "gates")
    assert ml.data.metrics["gate/complete"] == 1.0 and ml.data.tags["shopsimrl.kind"] == "gate"


def test_the_judge_tracks_its_agreement(
    tmp_path: Path, research_runs: ResearchRuns, testbed: LocalTestbed, mlflow_server: MlflowServer
) -> None:
    from tests.research.test_judge import _config, _env

    path = _config(tmp_path, str(research_runs.local), testbed.model_url)
    env = _env({"MLFLOW_TRACKING_URI": mlflow_server.uri, "MLFLOW_EXPERIMENT_NAME": "judges"})
    result = cli("judge", str(path), "--track", "mlflow", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tracked in mlflow" in result.stderr and "tracker_failed" not in result.stderr
    summary = json.loads((tmp_path / "judge-out" / "judge_summary.json").read_text(encoding="utf-8"))
    (ml,) = mlflow_runs(mlflow_server.uri, "judges")
    assert ml.data.metrics["judge/agreement/reward/kappa"] == pytest.approx(summary["agreement"]["reward"]["kappa"])
    assert ml.data.metrics["judge/episodes/judged"] == research_runs.episodes
    assert ml.data.params["rubric.rubric_sha256"] == summary["rubric"]["rubric_sha256"]
    # A label pair's name holds "~", which MLflow refuses in a metric name: logged with "_".
    assert ml.data.metrics["judge/agreement/labels/wrong_product_wrong_product/episodes"] == research_runs.episodes


def test_a_training_step_is_tracked_at_its_round(tmp_path: Path, wandb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shopsimrl.testbed.policy import PolicySettings
    from shopsimrl.testbed.policy import create_app as create_policy_app
    from shopsimrl.testbed.serving import running_server
    from shopsimrl.testbed.shop import ShopSettings
    from shopsimrl.testbed.shop import create_app as create_shop_app
    from tests.training.test_slime_step import _round

    monkeypatch.setenv("WANDB_MODE", "offline")  # the command inherits this environment
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    with (
        running_server(create_shop_app(ShopSettings(slots=16))) as shop,
        running_server(create_policy_app(PolicySettings(token_endpoint=True))) as model,
    ):
        done = _round(
            tmp_path, shop, model,
            "--over-sampling-batch-size", "4", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--out", str(tmp_path / "step.json"), "--track", "wandb", "--track-step", "3",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    step = json.loads((tmp_path / "step.json").read_text(encoding="utf-8"))
    wb = read_wandb_run(offline_runs(tmp_path)[0])
    assert wb.job_type == "training"
    at_three = [values for number, values in wb.history if number == 3 and "rollout/shopsim/group_count" in values]
    assert at_three and at_three[0]["rollout/shopsim/reward_mean"] == pytest.approx(
        step["metrics"]["rollout/shopsim/reward_mean"]
    )
    assert len(wb.table("groups")["data"]) == 4
    assert json.loads(wb.artifact_files("shopsimrl-training")["step.json"]) == step

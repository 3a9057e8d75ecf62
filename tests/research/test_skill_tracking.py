"""The skill builder's figures in real trackers: ``skills build --track`` against the real HTTP
model stub, W&B offline into a temporary folder read back from its files, MLflow against a real
tracking server (sqlite store); trackers that fail never change the build's exit code."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from shopsimrl.testbed.serving import free_port
from tests.openai_stub import OpenAIStub, Received, Reply, completion, tool_call
from tests.research.test_online_analysis import Round, one_per_status
from tests.research.test_skill_builder import failure_card, good_card, numbered, write_traces
from tests.research.test_skills_build import answer, write_config
from tests.research.trackers import (
    MlflowServer,
    mlflow_runs,
    offline_runs,
    read_wandb_run,
    start_mlflow_server,
    wandb_environment,
)
from tests.sharded.conftest import cli
from tests.testbed_process import LocalTestbed

pytestmark = pytest.mark.slow

LEAKING = "照着 ASIN 找商品"
"""A lesson the firewall's mentions_asin rule refuses: its card is kept, ineligible."""


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    with start_mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def leaky_answer(request: Received) -> Reply:
    """The build test's answers, but task 3's card copies an identifier."""
    if request.json["tools"][0]["function"]["name"] == "submit_success_cards":
        user = orjson.loads(request.json["messages"][1]["content"])
        if user["trace"]["instruction"].endswith("#3"):
            arguments = {"cards": [good_card(lesson=LEAKING)]}
            return Reply(json=completion(tool_calls=[tool_call("submit_success_cards", orjson.dumps(arguments).decode())]))
    return answer(request)


def _setup(tmp_path: Path, served: tuple[OpenAIStub, str], extra: str, shop: str) -> Path:
    """``shop``: where the failure analyst replays the failed trajectory."""
    server, url = served
    server.reset()
    server.responder = leaky_answer
    write_traces(tmp_path / "traces.jsonl", [numbered(1), numbered(2), numbered(3), numbered(4, success=False)])
    return write_config(tmp_path, url, extra=extra, shop=shop)


def _env(home: Path, **extra: str) -> dict[str, str]:
    return {**wandb_environment(home), **extra}


def test_skills_build_logs_its_figures_to_wandb_offline_and_mlflow(
    tmp_path: Path, served: tuple[OpenAIStub, str], mlflow_server: MlflowServer, testbed: LocalTestbed
) -> None:
    wandb_dir = tmp_path / "wandb-runs"
    config = _setup(
        tmp_path,
        served,
        "tracking:\n  backends: [wandb]\n  mode: offline\n  dir: wandb-runs\n  project: skills-tests\n"
        f"  tracking_uri: {mlflow_server.uri}\n",
        testbed.shop_url,
    )
    result = cli("skills", "build", str(config), "--track", "mlflow", env=_env(tmp_path / "home"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tracked in wandb: W&B offline run" in result.stderr and "tracked in mlflow: MLflow run" in result.stderr
    out = tmp_path / "out"
    analysis = json.loads((out / "analysis_summary.json").read_text(encoding="utf-8"))
    assert analysis["cards"] == {"total": 4, "eligible": 2, "placeholders": 0}  # the failure's card: NO_PROPOSAL
    assert analysis["firewall_findings"] == {"mentions_asin": 1}
    expected: dict[str, Any] = {
        "skills/trajectories/total": 4,
        "skills/trajectories/success": 3,
        "skills/trajectories/failure": 1,
        "skills/cards/total": 4,
        "skills/cards/eligible": 2,
        "skills/firewall_findings/mentions_asin": 1,
        "skills/firewall_findings/total": 1,
        "skills/consolidation/cards": 2,
        "skills/consolidation/clusters": 1,
        "skills/consolidation/evidence_only_cards": 0,
        "skills/chunks": 1,
    }

    (run_dir,) = offline_runs(wandb_dir)
    wb = read_wandb_run(run_dir)
    assert (wb.project, wb.name, wb.job_type, wb.exit_code) == ("skills-tests", "skills", "skills", 0)
    for key, value in expected.items():
        assert wb.summary[key] == value, key
    assert wb.table("firewall_findings") == {"columns": ["rule", "findings"], "data": [["mentions_asin", 1]]}
    files = wb.artifact_files("shopsimrl-skills")
    assert set(files) == {"analysis_summary.json", "consolidation_summary.json", "trace2skill_manifest.json"}
    assert json.loads(files["trace2skill_manifest.json"])["chunk_ids"] == ["search-with-attributes"]
    assert wb.config["shopsimrl"]["analyst"]["model"] == "stub-model"

    (ml,) = mlflow_runs(mlflow_server.uri, "skills-tests")
    assert ml.info.status == "FINISHED"
    for key, value in expected.items():
        assert ml.data.metrics[key] == value, key
    assert ml.data.params["stage"] == "cold_start" and ml.data.tags["shopsimrl.kind"] == "skills"


def test_failing_trackers_do_not_fail_the_build(tmp_path: Path, served: tuple[OpenAIStub, str], testbed: LocalTestbed) -> None:
    closed = free_port()  # nothing listens there
    config = _setup(
        tmp_path, served, f"tracking:\n  timeout_seconds: 5\n  tracking_uri: http://127.0.0.1:{closed}\n", testbed.shop_url
    )
    env = _env(tmp_path / "home", WANDB_MODE="online")  # and no API key: W&B refuses at once
    result = cli("skills", "build", str(config), "--track", "wandb", "--track", "mlflow", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("tracker_failed") == 2 and "tracked in" not in result.stderr
    assert "compilation    complete: 1 chunks (search-with-attributes)" in result.stdout
    unknown = cli("skills", "build", str(config), "--track", "neptune", env=env)
    assert unknown.returncode == 2 and "--track neptune: unknown tracker" in unknown.stderr


def test_skills_analyze_logs_the_online_round_to_wandb_offline(tmp_path: Path, stub: tuple[OpenAIStub, str]) -> None:
    """A real round through ``skills analyze --track wandb`` (a process of its own, as W&B runs
    are per process): three retries' cards, two eligible, one NO_PROPOSAL, consolidated into two
    candidates; the round's figures and files read back from the offline run."""
    server, url = stub
    server.reset()
    server.responder = one_per_status
    bed = Round(
        tmp_path,
        url,
        extra="environment: {base_url: 'http://127.0.0.1:1', timeout: 2}\n"
        "tracking:\n  backends: [wandb]\n  mode: offline\n  dir: wandb-runs\n  project: skills-tests\n",
    )
    for group, task in ((1, 21), (2, 22), (3, 23)):
        bed.add(group, task)
    bed.fixture_card(1, failure_card())
    bed.fixture_card(2, failure_card("PROPOSE_REWRITE", target="check-options"))
    bed.fixture_card(3, failure_card("NO_PROPOSAL"))
    done = cli("skills", "analyze", str(bed.config_path), env=_env(tmp_path / "home"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tracked in wandb: W&B offline run" in done.stderr
    (run_dir,) = offline_runs(tmp_path / "wandb-runs")
    wb = read_wandb_run(run_dir)
    assert (wb.project, wb.name, wb.job_type) == ("skills-tests", "round-1-analysis", "skills")
    assert wb.config["shopsimrl"]["stage"] == "online" and wb.config["shopsimrl"]["round_id"] == "round-1"
    expected = {
        "analysis/triage_groups": 3,
        "analysis/analyzed_cards": 3,
        "analysis/eligible_cards": 2,
        "analysis/no_proposal_cards": 1,
        "analysis/analyst_errors": 0,
        "analysis/candidates": 2,
        "analysis/complete": 1,
    }
    for key, value in expected.items():
        assert wb.summary[key] == value, key
    files = wb.artifact_files("shopsimrl-skills")
    assert {"analysis_summary.json", "candidate_pool.json", "proposal_ledger.jsonl"} <= set(files)
    assert orjson.loads(files["candidate_pool.json"]) == orjson.loads((bed.out / "candidate_pool.json").read_bytes())

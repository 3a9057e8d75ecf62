"""Online analysis of a training round on object storage (``training_round_dir: s3://…``), against
the real moto server and SeaweedFS: train-demo's rollout step written by the training store to the
bucket (triage records as objects, the diagnostics run as parts and commits), then `skills watch`
and `skills analyze` over the bucket and `skills analyze` over a local copy of the same round; the
cards and the pools are the same."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.records.io import dump_line
from shopsimrl.storage.objectstore import ObjectStore
from shopsimrl.storage.reading import open_run
from shopsimrl.training.triage import DIAGNOSTICS_DIR, PENDING_ANALYSIS, TRIAGE_DIR
from tests.sharded.conftest import S3Server, cli, moto_endpoint, s3_server, seaweedfs_endpoint
from tests.testbed_process import start_testbed

from .conftest import reaped

__all__ = ["moto_endpoint", "s3_server", "seaweedfs_endpoint"]  # the S3 servers' fixtures

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def selected_bank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gate demo's selected bank (made once, in a scratch tree): the curriculum train-demo uses."""
    root = tmp_path_factory.mktemp("gate-demo")
    (root / "scripts" / "lib").mkdir(parents=True)
    for name in ("gate-demo.sh", "lib/testbed.sh"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    for name in ("gate_demo", "splits"):
        shutil.copytree(REPO / "configs" / name, root / "configs" / name)
    env = {**os.environ, "BIN": str(Path(sys.executable).parent), "SHOPSIMRL_LOG_LEVEL": "warning"}
    made = subprocess.run(["bash", str(root / "scripts" / "gate-demo.sh")], capture_output=True, text=True, env=env, timeout=600)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    return root / "runs" / "gate-demo" / "gate" / "selected_skillbank.json"


def _checked(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _online_yaml(path: Path, *, name: str, round_dir: str, bank: Path, out: Path, shop: str, model: str) -> Path:
    path.write_text(
        f"online_analysis:\n  name: {name}\n  training_round_dir: {round_dir}\n  current_skillbank_path: {bank}\n"
        f"  output_dir: {out}\n  proposal_checkpoint: testbed-heuristic\n"
        f"environment: {{base_url: '{shop}', timeout: 30, persona: true}}\n"
        f"analyst_model: {{name: shopsim-analyst, base_url: '{model}', api_key_env: null, timeout: 30}}\n",
        encoding="utf-8",
    )
    return path


def _local_copy(location: str, root: Path) -> Path:
    """The round at ``location`` as a local run directory: its triage records as files, its
    diagnostics run's records (read back through the research reader) as traces.jsonl."""
    store = ObjectStore(location)
    triage = root / TRIAGE_DIR
    triage.mkdir(parents=True)
    for name in store.listdir(TRIAGE_DIR.as_posix()):
        data = store.read_bytes(f"{TRIAGE_DIR.as_posix()}/{name}")
        assert data is not None
        (triage / name).write_bytes(data)
    diagnostics = root / DIAGNOSTICS_DIR
    diagnostics.mkdir(parents=True)
    records = list(open_run(f"{location}/{DIAGNOSTICS_DIR.as_posix()}").records())
    assert records, "the diagnostics run on the store holds the retries"
    (diagnostics / "traces.jsonl").write_bytes(b"".join(dump_line(record) for record in records))
    return root


def _watch_until_carded(config: Path, out: Path, expected: int, env: dict[str, str]) -> None:
    """`skills watch` in a real subprocess until it has written ``expected`` cards, then stopped
    by its stop file (exit 0)."""
    stop = out.parent / f"{out.name}.stop"
    watch = subprocess.Popen(
        [sys.executable, "-m", "shopsimrl", "skills", "watch", str(config), "--poll-seconds", "0.2", "--stop-file", str(stop)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    with reaped(watch):
        deadline = time.monotonic() + 240
        cards = out / "failure_cards.jsonl"
        while not (cards.exists() and len(cards.read_text(encoding="utf-8").splitlines()) >= expected):
            assert watch.poll() is None, watch.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the watch did not card every retry in time"
            time.sleep(0.2)
        stop.touch()
        output, _ = watch.communicate(timeout=60)
    assert watch.returncode == 0, output[-3000:]
    assert output.count("analysed group-") == expected, output[-3000:]


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def test_a_round_on_object_storage_gives_the_pool_of_its_local_copy(
    s3_server: S3Server, selected_bank: Path, tmp_path: Path
) -> None:
    curriculum, tasks = tmp_path / "curriculum.json", tmp_path / "tasks.jsonl"
    _checked(
        cli(
            "training",
            "build-curriculum",
            str(selected_bank),
            str(curriculum),
            "--round-id",
            "1",
            "--skill-free-probability",
            "0.2",
            "--rho-min",
            "0.2",
            "--rho-max",
            "0.9",
        )
    )
    _checked(cli("training", "prepare-data", str(REPO / "configs/splits/persona_splits.v1.json"), "train", str(tasks)))
    text = (REPO / "configs" / "train_demo" / "training.yaml").read_text(encoding="utf-8")
    text = text.replace("../../runs/train-demo/curriculum.json", str(curriculum))
    text = text.replace("../../runs/gate-demo/gate/selected_skillbank.json", str(selected_bank))
    text = text.replace("../../runs/train-demo", f"s3://{s3_server.bucket}/train-demo")
    text = text.replace("../splits/", str(REPO / "configs" / "splits") + "/")
    config = tmp_path / "training.yaml"
    config.write_text(text, encoding="utf-8")
    location = f"s3://{s3_server.bucket}/train-demo/round-001"

    with start_testbed("--token-endpoint", SHOPSIM_POLICY_OPTIONS_NEED_SKILL="1") as bed:
        env = bed.env(SHOPSIMRL_TOKEN_ENDPOINT_URL=bed.model_url.removesuffix("/v1"), SHOPSIMRL_LOG_LEVEL="warning")
        step = cli(
            "training",
            "step",
            str(config),
            "--task-data",
            str(tasks),
            "--over-sampling-batch-size",
            "16",
            "--rollout-batch-size",
            "12",
            "--n-samples-per-prompt",
            "4",
            "--out",
            str(tmp_path / "round-001.json"),
            env=env,
            timeout=300,
        )
        _checked(step)
        assert not (tmp_path / "train-demo").exists()
        local = _local_copy(location, tmp_path / "local-round")
        pending = [
            path.name
            for path in sorted((local / TRIAGE_DIR).glob("group-*.json"))
            if _json(path)["classification"] == PENDING_ANALYSIS
        ]
        assert pending, "the round leaves groups pending analysis"
        results = {}
        for name, round_dir in (("objects", location), ("local", str(local))):
            path = _online_yaml(
                tmp_path / f"{name}.yaml",
                name="round-001",
                round_dir=round_dir,
                bank=selected_bank,
                out=tmp_path / name,
                shop=bed.shop_url,
                model=bed.model_url,
            )
            if name == "objects":  # `skills watch` on the bucket first: it analyses every retry
                _watch_until_carded(path, tmp_path / name, len(pending), env)
            results[name] = cli("skills", "analyze", str(path), env=env)
        # A location without triage records is named, exit 2.
        missing = _online_yaml(
            tmp_path / "missing.yaml",
            name="round-001",
            round_dir=f"s3://{s3_server.bucket}/nothing-here",
            bank=selected_bank,
            out=tmp_path / "missing",
            shop=bed.shop_url,
            model=bed.model_url,
        )
        refused = cli("skills", "analyze", str(missing), env=env)

    for result in results.values():
        _checked(result)
    summaries = {name: _json(tmp_path / name / "analysis_summary.json") for name in results}
    assert summaries["objects"]["status"] == "complete" and summaries["objects"]["triage"]["pending"] == len(pending)
    assert summaries["objects"]["triage"] == summaries["local"]["triage"]
    # The watch carded every retry, so the drain reused them all; the local analysis asked anew.
    assert summaries["objects"]["cards"]["reused"] == summaries["local"]["cards"]["analysed_now"] == len(pending)
    figures = ("total", "eligible", "no_proposal", "analyst_errors", "missing")
    assert [summaries["objects"]["cards"][k] for k in figures] == [summaries["local"]["cards"][k] for k in figures]

    # The same cards (the failure analyst replayed each retry read from the bucket), the same pool.
    def cards(name: str) -> list[dict[str, Any]]:
        lines = (tmp_path / name / "failure_cards.jsonl").read_text(encoding="utf-8").splitlines()
        return [{k: v for k, v in json.loads(line).items() if k not in ("started_at", "ended_at")} for line in lines]

    assert sorted(card["triage_file"] for card in cards("objects")) == pending
    assert cards("objects") == cards("local")
    pools = {name: _json(tmp_path / name / "candidate_pool.json") for name in results}
    assert pools["objects"]["candidates"], "the round's cards propose"
    assert pools["objects"]["pool_sha256"] == pools["local"]["pool_sha256"]
    assert {k: v for k, v in pools["objects"].items() if k != "created_at"} == {
        k: v for k, v in pools["local"].items() if k != "created_at"
    }

    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert (
        f"s3://{s3_server.bucket}/nothing-here holds no training/triage/group-*.json objects" in refused.stderr + refused.stdout
    )

"""`make online-demo` end to end (scripts/online-demo.sh in a scratch tree with the shipped
configs): the gate demo's selected bank, train-demo's rollout step with its triage, `skills
analyze` with the testbed analyst (each pending retry replayed live on the testbed shop), a small
bare val run and the online gate over the pool the analysis wrote. The gate must read that very
pool and give every candidate a verdict; a round with nothing pending breaks the chain."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.testbed.heuristics_skills import CHOOSE_OPTIONS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PENDING = "full_skill_failure_pending_analysis"
VERDICTS = {"selected", "not_selected", "rewrite_winner", "rewrite_loser", "budget_excluded"}


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _scratch(root: Path) -> dict[str, str]:
    for name in ("online-demo.sh", "online-demo-figures.py", "train-demo.sh", "gate-demo.sh", "lib/testbed.sh"):
        (root / "scripts" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    for name in ("online_demo", "train_demo", "gate_demo", "splits"):
        shutil.copytree(REPO / "configs" / name, root / "configs" / name)
    return {**os.environ, "BIN": str(Path(sys.executable).parent), "SHOPSIMRL_LOG_LEVEL": "warning"}


def _demo(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "scripts" / "online-demo.sh")], capture_output=True, text=True, env=env, timeout=900
    )


def test_online_demo_chains_triage_analysis_and_the_online_gate(tmp_path: Path) -> None:
    env = _scratch(tmp_path)
    result = _demo(tmp_path, env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    print(result.stdout)  # the figures, for the record (pytest -s)

    runs = tmp_path / "runs"
    triage = [_json(path) for path in sorted((runs / "train-demo" / "round-001" / "training" / "triage").glob("group-*.json"))]
    pending = [record for record in triage if record["classification"] == PENDING]
    assert pending, "the demo's round must leave a group pending analysis"

    # One card per pending retry, from the live failure analyst; some propose.
    analysis = runs / "online-demo" / "analysis"
    summary = _json(analysis / "analysis_summary.json")
    assert summary["status"] == "complete" and summary["triage"]["pending"] == len(pending)
    cards = [json.loads(line) for line in (analysis / "failure_cards.jsonl").read_text().splitlines() if line.strip()]
    assert sorted(card["episode_id"] for card in cards) == sorted(record["diagnostic"]["episode_id"] for record in pending)
    assert all(card["status"] in ("PROPOSE_ADD", "PROPOSE_REWRITE", "NO_PROPOSAL") for card in cards)
    assert any(card["eligible"] for card in cards)

    # The pool is what the gate read: same digest, the current bank the round trained with.
    pool = _json(analysis / "candidate_pool.json")
    bank = _json(runs / "gate-demo" / "gate" / "selected_skillbank.json")
    assert [skill["skill_id"] for skill in pool["current_skills"]] == [skill["skill_id"] for skill in bank["skills"]]
    assert pool["candidates"] and all(CHOOSE_OPTIONS in c["content"] for c in pool["candidates"])
    gate = runs / "online-demo" / "gate"
    manifest = _json(gate / "online_gate_manifest.json")
    assert manifest["status"] == "complete"
    assert manifest["input"]["pool_sha256"] == pool["pool_sha256"]
    assert manifest["summary"]["completed"] == manifest["summary"]["episodes"] > 0

    # A verdict per candidate (and per current chunk), each named in the printed figures.
    rows = {row["intervention_id"]: row for row in _json(gate / "contributions.json")["contributions"]}
    ids = [c["candidate_id"] for c in pool["candidates"]] + [s["skill_id"] for s in pool["current_skills"]]
    assert sorted(rows) == sorted(ids)
    for candidate in pool["candidates"]:
        row = rows[candidate["candidate_id"]]
        assert row["kind"] == "candidate" and row["operation"] == candidate["operation"]
        assert row["status"] in VERDICTS and row["ci_low"] <= row["coefficient"] <= row["ci_high"]
        assert f"{candidate['candidate_id']}  {candidate['operation']}" in result.stdout
        assert row["status"] in result.stdout
    assert f"{len(pending)} pending analysis" in result.stdout
    # The gate carries the pool's ledger forward: every candidate has its row.
    ledger = [json.loads(line) for line in (gate / "proposal_ledger.jsonl").read_text().splitlines() if line.strip()]
    assert {row["candidate_id"] for row in ledger} >= {c["candidate_id"] for c in pool["candidates"]}

    # Break the chain: the same round with nothing pending analysis. The analysis finds no retry,
    # the pool holds no candidate (the gate still runs, on the current bank alone), and the
    # demo exits 1 saying why.
    for path in sorted((runs / "train-demo" / "round-001" / "training" / "triage").glob("group-*.json")):
        record = _json(path)
        if record["classification"] == PENDING:
            path.write_text(json.dumps({**record, "classification": "model_internalization_deficit"}), encoding="utf-8")
    broken = _demo(tmp_path, env)
    assert broken.returncode == 1, broken.stdout[-3000:] + broken.stderr[-3000:]
    assert "; 0 pending analysis" in broken.stdout and "candidates    0 (ADD 0, REWRITE 0)" in broken.stdout
    assert "the chain broke: no triage group is pending analysis" in broken.stderr, broken.stderr[-3000:]
    assert "the chain broke: the pool holds no candidate" in broken.stderr
    assert _json(gate / "online_gate_manifest.json")["status"] == "complete"

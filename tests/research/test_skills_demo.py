"""`make skills-demo` end to end (scripts/skills-demo.sh in a scratch tree with the shipped
configs): a train run on the testbed, `skills build` with the testbed analyst (failed trajectories
replayed in live sessions on the testbed shop), a bare val run and
Gate A over the built draft; the chunk that carries the choose-options marker comes out positive,
the buy-first one negative. Then the review (Gate A's selection accepted, the rest rejected) and
the snapshot, which verifies and enables exactly the selected chunks. About 15 s on two cores
(60 train and 2 × 200 val episodes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.skills import JsonSkillBank, snapshot_id_of
from shopsimrl.testbed.heuristics_skills import BUY_FIRST, CHOOSE_OPTIONS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_skills_demo_builds_a_draft_whose_chunks_gate_a_signs_as_known(tmp_path: Path) -> None:
    for part in (
        "scripts/skills-demo.sh",
        "scripts/skills-demo-figures.py",
        "scripts/skills-demo-review.py",
        "scripts/lib/testbed.sh",
    ):
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / part, tmp_path / part)
    shutil.copytree(REPO / "configs" / "skills_demo", tmp_path / "configs" / "skills_demo")
    shutil.copytree(REPO / "configs" / "splits", tmp_path / "configs" / "splits")
    env = {**os.environ, "BIN": str(Path(sys.executable).parent), "SHOPSIMRL_LOG_LEVEL": "warning"}
    result = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "skills-demo.sh")], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(result.stdout)  # the figures, for the record (pytest -s)

    root = tmp_path / "runs" / "skills-demo"
    draft = json.loads((root / "draft" / "initial_skill_draft.json").read_text(encoding="utf-8"))
    bank = {s["skill_id"]: s["content"] for s in json.loads((root / "draft" / "initial_skillbank.json").read_text())["skills"]}
    assert [c["chunk_id"] for c in draft["chunks"]] == ["choose-requested-options", "buy-first-result"]
    assert CHOOSE_OPTIONS in bank["choose-requested-options"] and BUY_FIRST in bank["buy-first-result"]

    # Every card is grounded in steps its trajectory has, and none is refused by the firewall.
    traces = _lines(root / "train" / "traces.jsonl")
    steps = {t["episode_id"]: {s["step_index"] for s in t["steps"]} for t in traces}
    cards = [c for c in _lines(root / "draft" / "evidence_cards.jsonl") if not c["placeholder"]]
    success = [c for c in cards if c["channel"] == "success"]
    failure = [c for c in cards if c["channel"] == "failure"]
    assert success and all(c["eligible"] and not c["firewall_findings"] for c in success)
    assert all(ref["step"] in steps[ref["episode_id"]] for c in cards for ref in c["evidence_refs"])
    lessons = [c["card"]["generalizable_lesson"] for c in success]
    assert any(CHOOSE_OPTIONS in text for text in lessons) and any(BUY_FIRST in text for text in lessons)
    # Every failed trajectory has a failure card; a proposal (verified live, never forced back)
    # carries the choose-options marker, the rest are NO_PROPOSAL and not consolidated.
    assert len(failure) == sum(1 for t in traces if t["final"]["reward_detail"]["r_success"] == 0)
    assert all(not c["firewall_findings"] and not c["forced_no_proposal_reasons"] for c in failure)
    proposals = [c for c in failure if c["card"]["status"] == "PROPOSE_ADD"]
    assert proposals and all(c["eligible"] for c in proposals)
    assert all(CHOOSE_OPTIONS in c["card"]["deployable_abstraction"]["proposed_content"] for c in proposals)
    cited = sorted(card for chunk in draft["chunks"] for card in chunk["evidence_card_ids"])
    assert cited == sorted(c["card_id"] for c in cards if c["eligible"])

    fit = json.loads((root / "gate" / "contributions.json").read_text(encoding="utf-8"))
    rows = {row["chunk_id"]: row for row in fit["contributions"]}
    assert rows["choose-requested-options"]["coefficient"] > 0 and rows["choose-requested-options"]["status"] == "selected"
    assert rows["buy-first-result"]["coefficient"] < 0 and rows["buy-first-result"]["ci_high"] < 0
    assert fit["selected_chunk_ids"] == ["choose-requested-options"]
    assert "choose-requested-options" in result.stdout and "clusters" in result.stdout

    # The review: Gate A's selection accepted, the rest rejected, by the demo's reviewer.
    log = root / "draft" / "skill_review.jsonl"
    rows = _lines(log)
    assert sorted((r["chunk_id"], r["decision"], r["reviewer"]) for r in rows) == [
        ("buy-first-result", "rejected", "skills-demo"),
        ("choose-requested-options", "accepted", "skills-demo"),
    ]
    # The snapshot: its content address verifies, it enables exactly the selected chunks, and the
    # skill bank reader (which recomputes the address) reads it as that bank.
    path = root / "draft" / "skillbank.snapshot.json"
    snapshot = json.loads(path.read_text(encoding="utf-8"))
    assert snapshot["stage"] == "selected" and snapshot_id_of(snapshot) == snapshot["snapshot_id"]
    assert [s["skill_id"] for s in snapshot["skills"] if s["enabled"]] == fit["selected_chunk_ids"]
    assert [s["skill_id"] for s in snapshot["bank"]["skills"]] == fit["selected_chunk_ids"]
    assert {s["skill_id"]: s["review"]["status"] for s in snapshot["skills"]} == {
        "choose-requested-options": "accepted",
        "buy-first-result": "rejected",
    }
    reader = JsonSkillBank(path)
    assert reader.snapshot_id == snapshot["snapshot_id"]
    assert [skill.skill_id for skill, _ in reader.entries] == fit["selected_chunk_ids"]
    # Its address is in the demo's last lines.
    last = result.stdout.strip().splitlines()[-2:]
    assert last[0] == f"snapshot {snapshot['snapshot_id']} (selected) written: runs/skills-demo/draft/skillbank.snapshot.json"
    assert last[1].split() == ["enabled", *fit["selected_chunk_ids"]]

    # Run again (the testbed on new ports): every step resumes (the analyst's URL is no part of
    # a fingerprint, so nothing is asked again), the same draft, the same fit.
    again = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "skills-demo.sh")], capture_output=True, text=True, env=env, timeout=600
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert "(0 now:" in said and "60 already completed" in said
    assert json.loads((root / "draft" / "initial_skill_draft.json").read_text(encoding="utf-8")) == draft
    refit = json.loads((root / "gate" / "contributions.json").read_text(encoding="utf-8"))
    assert [r["coefficient"] for r in refit["contributions"]] == [r["coefficient"] for r in fit["contributions"]]
    # The review is already recorded (nothing appended) and the same snapshot is a no-op.
    assert _lines(log) == rows
    assert f"snapshot {snapshot['snapshot_id']} (selected) already there (identical; nothing written)" in again.stdout
    assert json.loads(path.read_text(encoding="utf-8")) == snapshot

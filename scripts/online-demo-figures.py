"""The figures of `make online-demo` (scripts/online-demo.sh): the round's triage groups, the
failure cards by status, the pool's candidates by operation and the online gate's verdict per
candidate. Exit 1 when the chain broke: no triage group pending analysis, an analysis that is not
complete or left a pending retry without a card, a pool without candidates, a gate that is not
complete or did not read this pool, or a candidate without a verdict.

Usage: online-demo-figures.py ROUND_DIR DEMO_DIR (train-demo's run directory, runs/online-demo)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

PENDING = "full_skill_failure_pending_analysis"


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _latest_cards(path: Path) -> dict[str, dict[str, Any]]:
    cards: dict[str, dict[str, Any]] = {}
    if not path.exists():  # nothing was pending: no card was written
        return cards
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            cards[record["episode_id"]] = record
    return cards


def main(round_dir: Path, root: Path) -> int:
    problems: list[str] = []
    triage = Counter(_json(path)["classification"] for path in sorted((round_dir / "training" / "triage").glob("group-*.json")))
    pending = triage.get(PENDING, 0)
    listed = ", ".join(f"{name} {count}" for name, count in sorted(triage.items()))
    print(f"online-demo: triage        {sum(triage.values())} groups ({listed}); {pending} pending analysis")
    if pending == 0:
        problems.append("no triage group is pending analysis: nothing for the failure analyst")

    analysis = root / "analysis"
    summary = _json(analysis / "analysis_summary.json")
    cards = _latest_cards(analysis / "failure_cards.jsonl")
    statuses = Counter(card["status"] for card in cards.values())
    eligible = sum(1 for card in cards.values() if card["eligible"])
    by_status = ", ".join(f"{name} {count}" for name, count in sorted(statuses.items())) or "none"
    print(f"online-demo: failure cards {len(cards)} ({by_status}); {eligible} eligible")
    if summary["status"] != "complete":
        problems.append(f"the online analysis is {summary['status']}: {(summary.get('error') or {}).get('message')}")
    if summary["cards"]["total"] != pending or summary["cards"]["missing"] or statuses.get("ANALYST_ERROR"):
        problems.append(f"{pending} retries pending but {summary['cards']} in {analysis / 'analysis_summary.json'}")

    pool = _json(analysis / "candidate_pool.json")
    operations = Counter(candidate["operation"] for candidate in pool["candidates"])
    print(
        f"online-demo: candidates    {len(pool['candidates'])} (ADD {operations.get('ADD', 0)}, "
        f"REWRITE {operations.get('REWRITE', 0)}) against {len(pool['current_skills'])} current chunks"
    )
    if not pool["candidates"]:
        problems.append("the pool holds no candidate: the gate would only measure the current bank")

    gate = root / "gate"
    manifest = _json(gate / "online_gate_manifest.json")
    if manifest["status"] != "complete":
        problems.append(f"the online gate is {manifest['status']} ({manifest['summary']})")
    if manifest["input"].get("pool_sha256") != pool["pool_sha256"]:
        problems.append(f"the gate read pool {manifest['input'].get('pool_sha256')}, not {pool['pool_sha256']}")
    fit = _json(gate / "contributions.json")
    rows = {row["intervention_id"]: row for row in fit["contributions"]}
    print(
        f"online-demo: gate          {manifest['summary']['completed']} paired val episodes, selected {fit['selected_intervention_ids']}"
    )
    for candidate in pool["candidates"]:
        row = rows.get(candidate["candidate_id"])
        target = f" of {candidate['target_chunk_id']}" if candidate["target_chunk_id"] else ""
        if row is None:
            problems.append(f"the gate gives no verdict on {candidate['candidate_id']}")
            continue
        print(
            f"online-demo:   {candidate['candidate_id']}  {candidate['operation']}{target}  "
            f"coef {row['coefficient']:+.4f} [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]  {row['status']}"
        )
    for row in fit["contributions"]:
        if row["kind"] == "current":
            print(f"online-demo:   {row['intervention_id']}  current  coef {row['coefficient']:+.4f}  {row['status']}")
    for problem in problems:
        print(f"online-demo: the chain broke: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))

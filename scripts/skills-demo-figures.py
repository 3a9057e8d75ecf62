"""The figures of `make skills-demo` (scripts/skills-demo.sh): cards, clusters and chunks of the
built draft and each chunk's Gate A reward coefficient. Exit 1 when the chunk carrying the
choose-options marker is not positive or the one carrying the buy-first marker is not negative:
the testbed's known effects, which the demo exists to show."""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHOOSE_OPTIONS = "[[testbed:choose-options]]"
BUY_FIRST = "[[testbed:buy-first]]"


def main(root: Path) -> int:
    draft = root / "draft"
    analysis = json.loads((draft / "analysis_summary.json").read_text(encoding="utf-8"))
    consolidation = json.loads((draft / "consolidation_summary.json").read_text(encoding="utf-8"))
    bank = json.loads((draft / "initial_skillbank.json").read_text(encoding="utf-8"))
    fit = json.loads((root / "gate" / "contributions.json").read_text(encoding="utf-8"))
    episodes = analysis["episodes"]
    statuses = (analysis.get("failure_cards") or {}).get("status") or {}
    proposals = sum(count for status, count in statuses.items() if status != "NO_PROPOSAL")
    print(
        f"skills-demo: {episodes['total']} train episodes ({episodes['success']} successful), "
        f"{proposals} failure proposals, {statuses.get('NO_PROPOSAL', 0)} NO_PROPOSAL, "
        f"{analysis['cards']['eligible']} eligible cards of {analysis['cards']['total']}, "
        f"{consolidation['clusters']} clusters, {len(bank['skills'])} chunks"
    )
    markers = {skill["skill_id"]: skill["content"] for skill in bank["skills"]}
    draft_chunks = json.loads((draft / "initial_skill_draft.json").read_text(encoding="utf-8"))["chunks"]
    evidence = {chunk["chunk_id"]: len(chunk["evidence_card_ids"]) for chunk in draft_chunks}
    rows = fit["contributions"]
    ok = True
    for row in rows:
        chunk, coef = row["chunk_id"], row["coefficient"]
        content = markers.get(chunk, "")
        want = "+" if CHOOSE_OPTIONS in content else "-" if BUY_FIRST in content else "?"
        print(
            f"  {chunk:26s} {evidence.get(chunk, 0):3d} cards  coef {coef:+.4f}  "
            f"95% CI [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]  {row['status']}"
        )
        ok = ok and not (want == "+" and coef <= 0) and not (want == "-" and coef >= 0)
    if not ok:
        print("skills-demo: a chunk's sign is not the testbed's known effect", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

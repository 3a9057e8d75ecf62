"""The review step of `make skills-demo` (scripts/skills-demo.sh): a review file that accepts
every chunk Gate A selected and rejects the others, as reviewer `skills-demo`. Only decisions
the review log does not already hold go in it, so a rerun appends nothing and freezes the same
snapshot. Prints how many decisions the file holds (0: nothing to review, no file written)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shopsimrl.research.skills.snapshot import review_status

REVIEWER = "skills-demo"


def main(draft: Path, selected: Path, out: Path) -> int:
    bank = json.loads(selected.read_text(encoding="utf-8"))
    chosen = {skill["skill_id"] for skill in bank["skills"] if skill.get("enabled", True) is not False}
    decisions = []
    for chunk_id, current in review_status(draft).items():
        wanted = "accept" if chunk_id in chosen else "reject"
        if current["status"] != f"{wanted}ed":
            note = "selected by Gate A" if chunk_id in chosen else "not selected by Gate A"
            decisions.append({"chunk_id": chunk_id, "decision": wanted, "note": note})
    out.unlink(missing_ok=True)
    if decisions:
        # JSON is YAML: `skills review --file` reads it as it is.
        out.write_text(json.dumps({"reviewer": REVIEWER, "decisions": decisions}, indent=2) + "\n", encoding="utf-8")
    print(len(decisions))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))

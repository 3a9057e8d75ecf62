#!/usr/bin/env bash
# `make skills-demo`: traces → draft → Gate A on the local testbed. Starts the testbed with the
# policy's option choice behind a skill (SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1), makes a train run
# (configs/skills_demo/train.yaml → runs/skills-demo/train), builds the skill from its traces with
# the testbed's deterministic analyst (configs/skills_demo/skills.yaml → runs/skills-demo/draft),
# makes the bare val run and runs Gate A over the built draft (→ runs/skills-demo/bare, gate),
# prints the figures, records the review of the draft (Gate A's selection accepted, the rest
# rejected, reviewer skills-demo) and freezes the selected chunks as the content-addressed
# snapshot runs/skills-demo/draft/skillbank.snapshot.json, and stops the services whatever
# happens. Running it again resumes each step (the review and the snapshot are no-ops then).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
source scripts/lib/testbed.sh
LOG=$(mktemp -t shopsimrl-skills-demo.XXXXXX.log)
SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1 start_testbed configs/skills_demo/train.yaml "$LOG"
echo "skills-demo: 1/5 the train run (no skills) → runs/skills-demo/train"
"$BIN/shopsimrl" run configs/skills_demo/train.yaml --no-progress -q | tail -n 2
echo "skills-demo: 2/5 skills build with the testbed analyst (shopsim-analyst) → runs/skills-demo/draft"
# The analyst is the policy server under another model name; its port is this run's, and so is
# the shop's, where the failure analyst replays the failed tasks. The copy
# sits at the same depth as configs/skills_demo/, so its relative paths resolve the same. The
# URL is no part of any stage's fingerprint: run again on new ports, every stage is reused.
mkdir -p runs/skills-demo
sed -e "s#http://127.0.0.1:8000/v1#$SHOPSIMRL_MODEL_BASE_URL#" -e "s#http://127.0.0.1:5700#$SHOPSIMRL_ENV_BASE_URL#" \
  configs/skills_demo/skills.yaml >runs/skills-demo/skills.yaml
"$BIN/shopsimrl" skills build runs/skills-demo/skills.yaml -q
echo "skills-demo: 3/5 the bare val run (no skills) → runs/skills-demo/bare"
"$BIN/shopsimrl" run configs/skills_demo/bare.yaml --no-progress -q | tail -n 2
echo "skills-demo: 4/5 Gate A over the built draft → runs/skills-demo/gate"
"$BIN/shopsimrl" gate run configs/skills_demo/gate.yaml --no-progress -q
"$BIN/python" scripts/skills-demo-figures.py runs/skills-demo
echo "skills-demo: 5/5 review (Gate A's selection) and the snapshot → runs/skills-demo/draft"
DRAFT=runs/skills-demo/draft
SELECTED=runs/skills-demo/gate/selected_skillbank.json
# Only the decisions the review log lacks: a rerun appends none, so the snapshot is the same.
if [ "$("$BIN/python" scripts/skills-demo-review.py "$DRAFT" "$SELECTED" runs/skills-demo/review.yaml)" != 0 ]; then
  "$BIN/shopsimrl" skills review "$DRAFT" --file runs/skills-demo/review.yaml -q
fi
"$BIN/shopsimrl" skills snapshot "$DRAFT" --selected "$SELECTED" -q

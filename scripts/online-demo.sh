#!/usr/bin/env bash
# `make online-demo`: the online loop on the testbed, from a training round to the gate's verdict.
# Reuses train-demo's round (runs/train-demo/round-001, made by `make train-demo` first when
# missing). Starts the testbed with the policy's option choice behind a skill
# (SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1, as the round ran), then:
#   1. `skills analyze` over the round's triage with the testbed analyst (shopsim-analyst), each
#      pending retry replayed in a live session on the testbed shop → runs/online-demo/analysis
#   2. a bare val run over a small val sample → runs/online-demo/bare
#   3. the online gate over the pool against the current bank → runs/online-demo/gate
#   4. the figures (scripts/online-demo-figures.py), which exit non-zero if the chain broke.
# Any failing step stops the script with its exit code; the services stop whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
ROUND=runs/train-demo/round-001
OUT=runs/online-demo
source scripts/lib/testbed.sh

if [ ! -d "$ROUND/training/triage" ]; then
  echo "online-demo: no $ROUND/training/triage yet; running the train demo first"
  BIN=$BIN scripts/train-demo.sh
fi
rm -rf "$OUT"
mkdir -p "$OUT"

LOG="$OUT/testbed.log"
SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1 start_testbed configs/online_demo/bare.yaml "$LOG"

echo "online-demo: 1/4 skills analyze over $ROUND's triage (shopsim-analyst) → $OUT/analysis"
# The analyst is the policy server under another model name, the live sessions run on this run's
# shop; the copy sits at the same depth as configs/online_demo/, so its relative paths hold.
sed -e "s#http://127.0.0.1:8000/v1#$SHOPSIMRL_MODEL_BASE_URL#" -e "s#http://127.0.0.1:5700#$SHOPSIMRL_ENV_BASE_URL#" \
  configs/online_demo/online.yaml >"$OUT/online.yaml"
"$BIN/shopsimrl" skills analyze "$OUT/online.yaml" -q
echo "online-demo: 2/4 the bare val run (a small val sample, no skills) → $OUT/bare"
"$BIN/shopsimrl" run configs/online_demo/bare.yaml --no-progress -q | tail -n 2
echo "online-demo: 3/4 the online gate over the pool against the current bank → $OUT/gate"
"$BIN/shopsimrl" gate run configs/online_demo/gate.yaml --no-progress -q
echo "online-demo: 4/4 the figures"
"$BIN/python" scripts/online-demo-figures.py "$ROUND" "$OUT"

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
free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

if [ ! -d "$ROUND/training/triage" ]; then
  echo "online-demo: no $ROUND/training/triage yet; running the train demo first"
  BIN=$BIN scripts/train-demo.sh
fi
rm -rf "$OUT"
mkdir -p "$OUT"

SHOP_PORT=${SHOP_PORT:-$(free_port)}
POLICY_PORT=${POLICY_PORT:-$(free_port)}
LOG="$OUT/testbed.log"
SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1 "$BIN/shopsimrl" testbed up --shop-port "$SHOP_PORT" --policy-port "$POLICY_PORT" >"$LOG" 2>&1 &
TESTBED_PID=$!
stop() { kill "$TESTBED_PID" 2>/dev/null || true; wait "$TESTBED_PID" 2>/dev/null || true; }
trap stop EXIT
export SHOPSIMRL_MODEL_BASE_URL="http://127.0.0.1:$POLICY_PORT/v1"
export SHOPSIMRL_ENV_BASE_URL="http://127.0.0.1:$SHOP_PORT"
if ! "$BIN/shopsimrl" wait-ready --config configs/online_demo/bare.yaml --timeout 90 --interval 0.5; then
  echo "testbed did not become ready; its log:" >&2; cat "$LOG" >&2; exit 3
fi

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

#!/usr/bin/env bash
# `make gate-demo`: a skill gate end to end on the local testbed. Starts the testbed with the
# policy's option choice behind a skill (SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1), makes the bare val
# run (configs/gate_demo/bare.yaml → runs/gate-demo/bare), runs Gate A over three chunks with known
# effects (configs/gate_demo/gate.yaml → runs/gate-demo/gate), prints the fit and where each file
# is, and stops the services whatever happens. Running it again resumes both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SHOP_PORT=${SHOP_PORT:-$(free_port)}
POLICY_PORT=${POLICY_PORT:-$(free_port)}
LOG=$(mktemp -t shopsimrl-gate-demo.XXXXXX.log)

SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1 "$BIN/shopsimrl" testbed up --shop-port "$SHOP_PORT" --policy-port "$POLICY_PORT" >"$LOG" 2>&1 &
TESTBED_PID=$!
stop() { kill "$TESTBED_PID" 2>/dev/null || true; wait "$TESTBED_PID" 2>/dev/null || true; }
trap stop EXIT

export SHOPSIMRL_MODEL_BASE_URL="http://127.0.0.1:$POLICY_PORT/v1"
export SHOPSIMRL_ENV_BASE_URL="http://127.0.0.1:$SHOP_PORT"
if ! "$BIN/shopsimrl" wait-ready --config configs/gate_demo/bare.yaml --timeout 90 --interval 0.5; then
  echo "testbed did not become ready; its log:" >&2; cat "$LOG" >&2; exit 3
fi
echo "gate-demo: 1/2 the bare val run (400 val tasks, no skills) → runs/gate-demo/bare"
"$BIN/shopsimrl" run configs/gate_demo/bare.yaml --no-progress -q | tail -n 2
echo "gate-demo: 2/2 Gate A: 400 masked rollouts over 3 chunks, then the paired fit → runs/gate-demo/gate"
"$BIN/shopsimrl" gate run configs/gate_demo/gate.yaml --no-progress -q

#!/usr/bin/env bash
# Start the testbed (shop + heuristic policy) on free loopback ports, run one config against it,
# print the summary, and stop the services whatever happens.
#   scripts/testbed-run.sh [CONFIG] [extra `shopsimrl run` flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/testbed_demo.yaml}
shift || true
# make passes BIN; run by hand, the development install, else the demo's light one.
if [ -z "${BIN:-}" ]; then
  if [ -x .venv/bin/shopsimrl ]; then BIN=.venv/bin; else BIN=.venv-demo/bin; fi
fi
free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SHOP_PORT=${SHOP_PORT:-$(free_port)}
POLICY_PORT=${POLICY_PORT:-$(free_port)}
LOG=$(mktemp -t shopsimrl-testbed.XXXXXX.log)

"$BIN/shopsimrl" testbed up --shop-port "$SHOP_PORT" --policy-port "$POLICY_PORT" >"$LOG" 2>&1 &
TESTBED_PID=$!
stop() { kill "$TESTBED_PID" 2>/dev/null || true; wait "$TESTBED_PID" 2>/dev/null || true; }
trap stop EXIT

export SHOPSIMRL_MODEL_BASE_URL="http://127.0.0.1:$POLICY_PORT/v1"
export SHOPSIMRL_ENV_BASE_URL="http://127.0.0.1:$SHOP_PORT"
if ! "$BIN/shopsimrl" wait-ready --config "$CONFIG" --timeout 90 --interval 0.5; then
  echo "testbed did not become ready; its log:" >&2; cat "$LOG" >&2; exit 3
fi
echo "testbed: shop $SHOPSIMRL_ENV_BASE_URL, policy $SHOPSIMRL_MODEL_BASE_URL (log: $LOG)"
"$BIN/shopsimrl" run "$CONFIG" "$@"

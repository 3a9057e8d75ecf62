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
source scripts/lib/testbed.sh
LOG=$(mktemp -t shopsimrl-testbed.XXXXXX.log)
start_testbed "$CONFIG" "$LOG"
echo "testbed: shop $SHOPSIMRL_ENV_BASE_URL, policy $SHOPSIMRL_MODEL_BASE_URL (log: $LOG)"
"$BIN/shopsimrl" run "$CONFIG" "$@"

#!/usr/bin/env bash
# `make gate-demo`: a skill gate end to end on the local testbed. Starts the testbed with the
# policy's option choice behind a skill (SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1), makes the bare val
# run (configs/gate_demo/bare.yaml → runs/gate-demo/bare), runs Gate A over three chunks with known
# effects (configs/gate_demo/gate.yaml → runs/gate-demo/gate), prints the fit and where each file
# is, and stops the services whatever happens. Running it again resumes both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
source scripts/lib/testbed.sh
LOG=$(mktemp -t shopsimrl-gate-demo.XXXXXX.log)
SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1 start_testbed configs/gate_demo/bare.yaml "$LOG"
echo "gate-demo: 1/2 the bare val run (400 val tasks, no skills) → runs/gate-demo/bare"
"$BIN/shopsimrl" run configs/gate_demo/bare.yaml --no-progress -q | tail -n 2
echo "gate-demo: 2/2 Gate A: 400 masked rollouts over 3 chunks, then the paired fit → runs/gate-demo/gate"
"$BIN/shopsimrl" gate run configs/gate_demo/gate.yaml --no-progress -q

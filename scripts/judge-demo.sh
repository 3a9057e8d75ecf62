#!/usr/bin/env bash
# `make judge-demo`: the judge stage end to end on the local testbed. Starts the testbed (its
# policy server also answers as the deterministic judge, model shopsim-judge; 4% of episodes get
# malformed or missing verdicts, SHOPSIM_POLICY_JUDGE_FAULT_RATE, so repairs and unparseable
# verdicts show), makes the 400-episode val run (configs/judge_demo/run.yaml → runs/judge-demo/val-run),
# then judges it sharded 4 ways through the local Indexed Job (judge plan → 4 judge workers →
# judge reduce) into runs/judge-demo/judge, prints the agreement figures and where the files
# are, and stops the services whatever happens. Running it again resumes both stages.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SHOP_PORT=${SHOP_PORT:-$(free_port)}
POLICY_PORT=${POLICY_PORT:-$(free_port)}
LOG=$(mktemp -t shopsimrl-judge-demo.XXXXXX.log)
OUT="$(pwd)/runs/judge-demo/judge"

SHOPSIM_POLICY_JUDGE_FAULT_RATE=${SHOPSIM_POLICY_JUDGE_FAULT_RATE:-0.04} \
  "$BIN/shopsimrl" testbed up --shop-port "$SHOP_PORT" --policy-port "$POLICY_PORT" >"$LOG" 2>&1 &
TESTBED_PID=$!
stop() { kill "$TESTBED_PID" 2>/dev/null || true; wait "$TESTBED_PID" 2>/dev/null || true; }
trap stop EXIT

export SHOPSIMRL_MODEL_BASE_URL="http://127.0.0.1:$POLICY_PORT/v1"
export SHOPSIMRL_ENV_BASE_URL="http://127.0.0.1:$SHOP_PORT"
export SHOPSIMRL_JUDGE_BASE_URL="http://127.0.0.1:$POLICY_PORT/v1"
if ! "$BIN/shopsimrl" wait-ready --config configs/judge_demo/run.yaml --timeout 90 --interval 0.5; then
  echo "testbed did not become ready; its log:" >&2; cat "$LOG" >&2; exit 3
fi
echo "judge-demo: 1/2 the val run (400 val tasks, heuristic policy) → runs/judge-demo/val-run"
"$BIN/shopsimrl" run configs/judge_demo/run.yaml --no-progress -q | tail -n 2
echo "judge-demo: 2/2 the testbed judge, 4 shards (plan → 4 workers → reduce) → $OUT"
status=0
"$BIN/shopsimrl" judge configs/judge_demo/judge.yaml --shards 4 --out "$OUT" -q || status=$?
echo "judge-demo: judge plan and shards under $OUT (judge_plan.json, inputs/, shards/NNNNN/part-*.jsonl.zst + _SUCCESS*.json)"
exit "$status"

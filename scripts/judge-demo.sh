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
source scripts/lib/testbed.sh
LOG=$(mktemp -t shopsimrl-judge-demo.XXXXXX.log)
OUT="$(pwd)/runs/judge-demo/judge"

SHOPSIM_POLICY_JUDGE_FAULT_RATE=${SHOPSIM_POLICY_JUDGE_FAULT_RATE:-0.04} start_testbed configs/judge_demo/run.yaml "$LOG"
export SHOPSIMRL_JUDGE_BASE_URL="$SHOPSIMRL_MODEL_BASE_URL"
echo "judge-demo: 1/2 the val run (400 val tasks, heuristic policy) → runs/judge-demo/val-run"
"$BIN/shopsimrl" run configs/judge_demo/run.yaml --no-progress -q | tail -n 2
echo "judge-demo: 2/2 the testbed judge, 4 shards (plan → 4 workers → reduce) → $OUT"
status=0
"$BIN/shopsimrl" judge configs/judge_demo/judge.yaml --shards 4 --out "$OUT" -q || status=$?
echo "judge-demo: judge plan and shards under $OUT (judge_plan.json, inputs/, shards/NNNNN/part-*.jsonl.zst + _SUCCESS*.json)"
exit "$status"

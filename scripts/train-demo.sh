#!/usr/bin/env bash
# `make train-demo`: one GRPO-shaped rollout step on the testbed through the slime adapter.
# The curriculum comes from the gate demo's selected bank (runs/gate-demo/gate, made by
# `make gate-demo` first when missing); the testbed policy runs with the option choice behind a
# skill (SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1), so the curriculum's draws change the rewards.
# Steps: build the curriculum and the task data, the preflight, then `training step`
# (16 groups x 4 samples: adapter, filter, normaliser, triage, metrics), then the research tools
# on the rollouts' traces. Everything lands in runs/train-demo/ (started afresh each time).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=runs/train-demo
BANK=runs/gate-demo/gate/selected_skillbank.json
source scripts/lib/testbed.sh  # free_port, stop_testbed

if [ ! -f "$BANK" ]; then
  echo "train-demo: no $BANK yet; running the gate demo first"
  BIN=$BIN scripts/gate-demo.sh
fi
rm -rf "$OUT"
mkdir -p "$OUT"
echo "train-demo: 1/5 curriculum from $BANK (q 0.2, rho 0.2-0.9) and the train task data"
"$BIN/shopsimrl" training build-curriculum "$BANK" "$OUT/curriculum.json" --round-id 1 \
  --skill-free-probability 0.2 --rho-min 0.2 --rho-max 0.9
"$BIN/shopsimrl" training prepare-data configs/splits/persona_splits.v1.json train "$OUT/tasks.jsonl"
echo "train-demo: 2/5 preflight"
"$BIN/shopsimrl" training check configs/train_demo/training.yaml --task-data "$OUT/tasks.jsonl"

SHOP_PORT=${SHOP_PORT:-$(free_port)}
POLICY_PORT=${POLICY_PORT:-$(free_port)}
LOG="$OUT/testbed.log"
SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1 "$BIN/shopsimrl" testbed up --token-endpoint \
  --shop-port "$SHOP_PORT" --policy-port "$POLICY_PORT" >"$LOG" 2>&1 &
TESTBED_PID=$!
trap stop_testbed EXIT
export SHOPSIMRL_ENV_BASE_URL="http://127.0.0.1:$SHOP_PORT"
export SHOPSIMRL_TOKEN_ENDPOINT_URL="http://127.0.0.1:$POLICY_PORT"
ready() {  # both services answer 200: the shop's /healthz, the policy's model list
  "$BIN/python" - "$SHOPSIMRL_ENV_BASE_URL/healthz" "http://127.0.0.1:$POLICY_PORT/v1/models" <<'PY'
import sys, time, urllib.request
deadline = time.monotonic() + 90
for url in sys.argv[1:]:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.3)
PY
}
if ! ready; then
  echo "testbed did not become ready; its log:" >&2; cat "$LOG" >&2; exit 3
fi

echo "train-demo: 3/5 one rollout step: 16 groups x 4 samples, 12 groups to the trainer"
"$BIN/shopsimrl" training step configs/train_demo/training.yaml --task-data "$OUT/tasks.jsonl" \
  --over-sampling-batch-size 16 --rollout-batch-size 12 --n-samples-per-prompt 4 --out "$OUT/round-001.json"
RUN="$OUT/round-001"
echo "train-demo: 4/5 the rollouts' traces through the research tools"
"$BIN/shopsimrl" labels "$RUN" | tail -n 14
echo "train-demo: 5/5 where things are"
echo "  traces (v4):        $RUN/traces.jsonl    (shopsimrl view $RUN)"
echo "  trainer's samples:  $RUN/training/samples.jsonl"
echo "  triage:             $RUN/training/triage/"
echo "  the step's record:  $OUT/round-001.json"

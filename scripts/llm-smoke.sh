#!/usr/bin/env bash
# A real LLM end to end: the llama.cpp server environment (~/.cache/shopsimrl/llm/venv, built once per
# machine, never .venv) and SmolLM2-135M, served on a free loopback port; the testbed shop; one
# config run against both (fresh run directory); the summary; both servers stopped.
#   scripts/llm-smoke.sh [CONFIG] [extra `shopsimrl run` flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/smoke_llm.yaml}
shift || true
BIN=${BIN:-.venv/bin}
# SmolLM2 was trained with 8k positions; 16k leaves room for two ~5k-token result pages.
N_CTX=${N_CTX:-16384}
N_THREADS=${N_THREADS:-2}
free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

"$BIN/python" -m shopsimrl.testbed.llm install

SHOP_PORT=${SHOP_PORT:-$(free_port)}
LLM_PORT=${LLM_PORT:-$(free_port)}
SHOP_LOG=$(mktemp -t shopsimrl-shop.XXXXXX.log)
LLM_LOG=$(mktemp -t shopsimrl-llama.XXXXXX.log)
PIDS=()
stop() {
  local pid i
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  # uvicorn drains in-flight requests on SIGTERM; a generation must not hold the exit up.
  for i in $(seq 50); do
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && break; pid=; done
    [ -z "$pid" ] && break
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
}
trap stop EXIT
trap 'exit 130' INT TERM

"$BIN/python" -m shopsimrl.testbed.llm serve --port "$LLM_PORT" --n-ctx "$N_CTX" --n-threads "$N_THREADS" >"$LLM_LOG" 2>&1 &
PIDS+=($!)
"$BIN/shopsimrl" testbed shop --port "$SHOP_PORT" >"$SHOP_LOG" 2>&1 &
PIDS+=($!)

export SHOPSIMRL_MODEL_BASE_URL="http://127.0.0.1:$LLM_PORT/v1"
export SHOPSIMRL_ENV_BASE_URL="http://127.0.0.1:$SHOP_PORT"
if ! "$BIN/shopsimrl" wait-ready --config "$CONFIG" --timeout 120 --interval 0.5; then
  echo "servers did not become ready; llama.cpp log ($LLM_LOG):" >&2; tail -n 30 "$LLM_LOG" >&2
  echo "shop log ($SHOP_LOG):" >&2; tail -n 30 "$SHOP_LOG" >&2; exit 3
fi
echo "llama.cpp: $SHOPSIMRL_MODEL_BASE_URL (log: $LLM_LOG); shop: $SHOPSIMRL_ENV_BASE_URL (log: $SHOP_LOG)"

# A smoke run always starts fresh: resuming would skip every episode of the previous smoke.
RUN_DIR=$("$BIN/shopsimrl" plan "$CONFIG" --json | "$BIN/python" -c 'import json, sys; print(json.load(sys.stdin)["run_dir"])')
rm -rf -- "$RUN_DIR"

set +e
# Read the whole help text: `grep -q` would exit early and, under pipefail, fail the pipeline.
RUN_HELP=$(COLUMNS=200 "$BIN/shopsimrl" run --help 2>/dev/null || true)
if [[ $RUN_HELP == *--shards* ]]; then
  "$BIN/shopsimrl" run "$CONFIG" --shards 2 --no-progress "$@"
else
  "$BIN/shopsimrl" run "$CONFIG" --no-progress "$@"
fi
rc=$?
# The same model as a judge of the smoke run (configs/judge_smoke_llm.yaml): a 135M model mostly
# fails the verdict schema, so unparseable verdicts are expected and never fail the smoke.
JUDGE_CONFIG=${JUDGE_CONFIG:-configs/judge_smoke_llm.yaml}
if [ "$rc" -le 1 ] && [ -f "$JUDGE_CONFIG" ] && [ "$CONFIG" = configs/smoke_llm.yaml ]; then
  rm -rf -- runs/smoke-llm-judge
  echo "judge: $JUDGE_CONFIG with the same server"
  SHOPSIMRL_JUDGE_BASE_URL="$SHOPSIMRL_MODEL_BASE_URL" "$BIN/shopsimrl" judge "$JUDGE_CONFIG" -q \
    || echo "judge: exit $? (not a smoke failure; see runs/smoke-llm-judge/judge_outputs.jsonl)"
fi
set -e
# Throughput over the whole run, from llama.cpp's per-completion timing lines.
awk '$2 == "prompt" && $3 == "eval" { pm += $6; pt += $9 }
     $2 == "eval" && $3 == "time" { gm += $5; gt += $8 }
     END { if (pm > 0 && gm > 0) printf "llama.cpp: prompt %d tokens at %.0f tok/s, generated %d tokens at %.0f tok/s\n", pt, pt * 1000 / pm, gt, gt * 1000 / gm }' "$LLM_LOG" || true
exit "$rc"

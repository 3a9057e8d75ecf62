#!/usr/bin/env bash
# End-to-end smoke run on a kind cluster: MinIO from k8s/overlays/smoke, the chart in testbed
# mode (heuristic policy + synthetic shop from the testbed image), an Indexed Job of 2 shards and
# the in-cluster reducer Job watching it (the kube image). Fails unless both Jobs complete, the
# reducer's summary.json is complete with coverage 1.0, and `make reduce` from this machine
# (through a port-forward) agrees with it. Whatever happens, ARTIFACTS_DIR receives the summary,
# every pod's logs, `kubectl describe` of the Jobs and pods, and the namespace's events.
#
#   scripts/smoke-k8s.sh               the smoke run (`make smoke-k8s` builds the images first)
#   scripts/smoke-k8s.sh --preflight   only check docker (and its daemon), kind and python
#
# Env: KIND_CLUSTER (shopsimrl-smoke)  IMAGE (shopsimrl)  IMAGE_TAG (dev)  NAMESPACE
#      (shopsimrl-smoke)  RELEASE (smoke)  TIMEOUT_S (900)  HELM / KUBECTL (.tools/bin/*)
#      DOCKER (docker)  KIND (kind)  PYTHON (.venv/bin/python)  MAKE (make)
#      ARTIFACTS_DIR (.cache/smoke-k8s)  KIND_VERSION / KIND_NODE_IMAGE (the pins below)
# kind and its node image are pinned: the node image is the one kind v0.27.0 was released with,
# Kubernetes v1.32, the minor of the kubectl scripts/install-helm.sh installs (v1.32.3); the run
# refuses another kind, and a cluster whose nodes run another minor than kubectl.
# The images are IMAGE (workers), IMAGE-kube (the reducer: it reads its worker Job through the
# Kubernetes API) and IMAGE-testbed (shop and policy), all tagged IMAGE_TAG.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

DOCKER="${DOCKER:-docker}"
KIND="${KIND:-kind}"
KIND_CLUSTER="${KIND_CLUSTER:-shopsimrl-smoke}"
KIND_VERSION="${KIND_VERSION:-v0.27.0}"
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-kindest/node:v1.32.2@sha256:f226345927d7e348497136874b6d207e0b32cc52154ad8323129352923a3142f}"
IMAGE="${IMAGE:-shopsimrl}"
IMAGE_TAG="${IMAGE_TAG:-dev}"
NAMESPACE="${NAMESPACE:-shopsimrl-smoke}"
RELEASE="${RELEASE:-smoke}"
TIMEOUT_S="${TIMEOUT_S:-900}"
HELM="${HELM:-$repo_root/.tools/bin/helm}"
KUBECTL="${KUBECTL:-$repo_root/.tools/bin/kubectl}"
PYTHON="${PYTHON:-$repo_root/.venv/bin/python}"
MAKE="${MAKE:-make}"
ARTIFACTS_DIR="${ARTIFACTS_DIR:-$repo_root/.cache/smoke-k8s}"
CHART="helm/shopsimrl"
OVERLAY="k8s/overlays/smoke"
CONTEXT="kind-$KIND_CLUSTER"
FORWARD_PID=""

log() { printf '[smoke-k8s] %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
kc() { "$KUBECTL" --context "$CONTEXT" -n "$NAMESPACE" "$@"; }

# Docker first, with its daemon: without one, `docker build` would fail later with less to say.
preflight() {
  command -v "$DOCKER" >/dev/null 2>&1 \
    || { log "needs Docker ($DOCKER is not on PATH): install Docker, or set DOCKER"; return 2; }
  "$DOCKER" info >/dev/null 2>&1 \
    || { log "needs a running Docker daemon ($DOCKER info fails: is dockerd up, may this user reach it?)"; return 2; }
  command -v "$KIND" >/dev/null 2>&1 \
    || { log "needs kind ($KIND is not on PATH): https://kind.sigs.k8s.io, or set KIND"; return 2; }
  local kind_version
  kind_version="$("$KIND" version 2>/dev/null || true)"
  [[ "$kind_version" == "kind $KIND_VERSION "* ]] \
    || { log "needs kind $KIND_VERSION (its node image $KIND_NODE_IMAGE is built for it), found: ${kind_version:-none}"; return 2; }
  [ -x "$PYTHON" ] || { log "needs the project's venv ($PYTHON): make install"; return 2; }
}

# wait_for_port PORT TRIES [PID]: 0 once 127.0.0.1:PORT accepts a connection; 1 when it did not
# within TRIES seconds, or as soon as the process PID (the port-forward) is gone.
wait_for_port() {
  local port=$1 tries=$2 pid=${3:-} _
  for _ in $(seq 1 "$tries"); do
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then return 1; fi
    "$PYTHON" -c "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1).close()" \
      "$port" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}

# wait_for_job JOB TIMEOUT_S: poll both terminal conditions (`kubectl wait --for=condition=Complete`
# would sit out the whole timeout on a Job that already failed). 0 Complete, 1 Failed, 2 timeout.
wait_for_job() {
  local job=$1 deadline=$(( $(date +%s) + $2 )) state
  while [ "$(date +%s)" -lt "$deadline" ]; do
    state="$(kc get job "$job" -o jsonpath='{range .status.conditions[?(@.status=="True")]}{.type} {end}')"
    case " $state " in
      *" Complete "*) return 0 ;;
      *" Failed "*) return 1 ;;
    esac
    sleep 5
  done
  return 2
}

# The nodes run the Kubernetes minor of the pinned node image, and kubectl is that minor too
# (a cluster made elsewhere, e.g. by the workflow's kind action, is checked the same way).
check_versions() {
  local node client want
  want="$(sed -E 's/^.*:v([0-9]+\.[0-9]+)\..*$/\1/' <<<"$KIND_NODE_IMAGE")"
  node="$("$KUBECTL" --context "$CONTEXT" get nodes -o jsonpath='{.items[0].status.nodeInfo.kubeletVersion}')"
  client="$("$KUBECTL" version --client 2>/dev/null | sed -n 's/^Client Version: //p')"
  log "kind $KIND_VERSION, node $node, kubectl $client"
  [[ "$node" == "v$want."* ]] || die "the cluster's nodes run $node, not v$want from $KIND_NODE_IMAGE"
  [[ "$client" == "v$want."* ]] || die "kubectl is $client, not the nodes' minor v$want (scripts/install-helm.sh)"
}

secret_value() { kc get secret minio-credentials -o "jsonpath={.data.$1}" | base64 -d; }

# The newest Job of one chart component (worker or reducer) of this release.
job_of() {
  kc get jobs -l "app.kubernetes.io/instance=$RELEASE,app.kubernetes.io/component=$1" \
    --sort-by=.metadata.creationTimestamp -o jsonpath='{.items[-1:].metadata.name}'
}

# Everything a failed (or passed) run needs to be understood afterwards; never a Secret's data.
collect_artifacts() {
  mkdir -p "$ARTIFACTS_DIR/logs"
  log "collecting artifacts into $ARTIFACTS_DIR"
  kc get jobs,pods,svc,configmaps -o wide >"$ARTIFACTS_DIR/resources.txt" 2>&1 || true
  kc describe jobs,pods -l "app.kubernetes.io/instance=$RELEASE" >"$ARTIFACTS_DIR/describe.txt" 2>&1 || true
  kc describe deployments,pods -l "app.kubernetes.io/name=minio" >>"$ARTIFACTS_DIR/describe.txt" 2>&1 || true
  kc get events --sort-by=.lastTimestamp >"$ARTIFACTS_DIR/events.txt" 2>&1 || true
  local pod
  for pod in $(kc get pods -l "app.kubernetes.io/instance=$RELEASE" -o name 2>/dev/null); do
    kc logs "$pod" --all-containers --prefix >"$ARTIFACTS_DIR/logs/${pod#pod/}.log" 2>&1 || true
  done
}

main() {
  cd "$repo_root"
  preflight || exit $?
  if [ "${1:-}" = "--preflight" ]; then return 0; fi
  for tool in "$HELM" "$KUBECTL"; do
    [ -x "$tool" ] || die "missing $tool (make helm-bin)"
  done
  rm -rf "$ARTIFACTS_DIR"
  mkdir -p "$ARTIFACTS_DIR"
  trap 'collect_artifacts; [ -z "$FORWARD_PID" ] || kill "$FORWARD_PID" 2>/dev/null || true' EXIT

  local clusters
  clusters="$("$KIND" get clusters 2>/dev/null || true)"
  if ! grep -qx "$KIND_CLUSTER" <<<"$clusters"; then
    log "creating kind cluster $KIND_CLUSTER from $KIND_NODE_IMAGE"
    "$KIND" create cluster --name "$KIND_CLUSTER" --image "$KIND_NODE_IMAGE" --wait 180s
  fi
  check_versions
  local image
  for image in "$IMAGE" "$IMAGE-kube" "$IMAGE-testbed"; do
    log "loading $image:$IMAGE_TAG into the cluster"
    "$KIND" load docker-image "$image:$IMAGE_TAG" --name "$KIND_CLUSTER"
  done

  log "deploying MinIO ($OVERLAY)"
  "$KUBECTL" --context "$CONTEXT" apply -k "$OVERLAY"
  kc rollout status deployment/minio --timeout=300s
  kc wait --for=condition=Complete job/minio-make-bucket --timeout=300s

  log "installing release $RELEASE in testbed mode"
  "$HELM" --kube-context "$CONTEXT" upgrade --install "$RELEASE" "$CHART" \
    --namespace "$NAMESPACE" -f "$CHART/ci/testbed-smoke-values.yaml" \
    --set "worker.image.repository=$IMAGE" --set "worker.image.tag=$IMAGE_TAG" \
    --set "reducer.image.repository=$IMAGE-kube" --set "testbed.image.repository=$IMAGE-testbed" \
    --wait --timeout 5m || die "helm install"

  local job reducer run_uri rc
  job="$(job_of worker)"
  reducer="$(job_of reducer)"
  [ -n "$job" ] || die "no worker Job for release $RELEASE"
  [ -n "$reducer" ] || die "no reducer Job for release $RELEASE (reducer.enabled in the smoke values?)"
  run_uri="$(kc get job "$job" -o jsonpath='{.metadata.annotations.shopsimrl\.io/run-uri}')"

  log "waiting for the worker Job $job (run $run_uri), at most ${TIMEOUT_S}s"
  rc=0; wait_for_job "$job" "$TIMEOUT_S" || rc=$?
  case $rc in
    0) log "Job $job complete: indexes $(kc get job "$job" -o jsonpath='{.status.completedIndexes}')" ;;
    1) die "Job $job failed (failed indexes: $(kc get job "$job" -o jsonpath='{.status.failedIndexes}'))" ;;
    *) die "Job $job did not finish within ${TIMEOUT_S}s" ;;
  esac
  # The reducer waits for the shards' commit markers, then writes summary.json and exits 0.
  log "waiting for the reducer Job $reducer, at most ${TIMEOUT_S}s"
  rc=0; wait_for_job "$reducer" "$TIMEOUT_S" || rc=$?
  case $rc in
    0) log "reducer Job $reducer complete" ;;
    1) die "reducer Job $reducer failed (its log is in $ARTIFACTS_DIR/logs)" ;;
    *) die "reducer Job $reducer did not finish within ${TIMEOUT_S}s" ;;
  esac

  # Read the store from this machine, as a user would, through a port-forward to MinIO.
  local port
  port="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  kc port-forward --address 127.0.0.1 svc/minio "$port:9000" >"$ARTIFACTS_DIR/port-forward.log" 2>&1 &
  FORWARD_PID=$!
  wait_for_port "$port" 30 "$FORWARD_PID" \
    || die "port-forward to svc/minio on 127.0.0.1:$port did not open: $(tail -n 5 "$ARTIFACTS_DIR/port-forward.log")"

  AWS_ACCESS_KEY_ID="$(secret_value MINIO_ROOT_USER)"
  AWS_SECRET_ACCESS_KEY="$(secret_value MINIO_ROOT_PASSWORD)"
  export AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY
  export AWS_ENDPOINT_URL="http://127.0.0.1:$port" AWS_DEFAULT_REGION="us-east-1"

  log "checking the reducer's summary.json"
  check_summary "$run_uri" "$ARTIFACTS_DIR/summary-reducer.json"
  log "make reduce RUN=$run_uri (from this machine)"
  "$MAKE" reduce RUN="$run_uri"
  check_summary "$run_uri" "$ARTIFACTS_DIR/summary.json" "$ARTIFACTS_DIR/summary-reducer.json"
  log "passed"
}

# check_summary RUN_URI COPY [EXPECTED]: the run's summary.json (a copy kept as an artifact) is
# complete with coverage 1.0, counts every episode the smoke values plan (sample_size x repeats)
# as completed and none failed, over every shard; with EXPECTED, its counts equal that summary's.
check_summary() {
  "$PYTHON" - "$@" <<'PY'
import json
import sys
from pathlib import Path

import fsspec
import yaml

values = yaml.safe_load(Path("helm/shopsimrl/ci/testbed-smoke-values.yaml").read_text())
planned = values["config"]["tasks"]["sample_size"] * values["config"]["tasks"]["repeats"]
shards = values["job"]["shards"]
uri = sys.argv[1].rstrip("/") + "/summary.json"
with fsspec.open(uri, "rb") as fh:
    raw = fh.read()
Path(sys.argv[2]).write_bytes(raw)
summary = json.loads(raw)
counts = summary.get("counts", {})
coverage = counts.get("coverage")
print(f"[smoke-k8s] {uri}: completed {counts.get('completed')}/{counts.get('requested')}, failed {counts.get('failed')}, "
      f"coverage {coverage}, complete {summary.get('complete')}, shards {summary.get('shards', {}).get('committed')}", file=sys.stderr)
if coverage != 1.0 or summary.get("complete") is not True:
    sys.exit(f"[smoke-k8s] FAILED: coverage {coverage}, complete {summary.get('complete')}: {summary.get('incomplete')}")
expected = {"requested": planned, "completed": planned, "failed": 0}
if any(counts.get(key) != value for key, value in expected.items()) or summary.get("shards", {}).get("committed") != shards:
    sys.exit(f"[smoke-k8s] FAILED: counts {counts}, shards {summary.get('shards')}; expected {expected} over {shards} shards")
if len(sys.argv) > 3:
    expected = json.loads(Path(sys.argv[3]).read_text())["counts"]
    keys = ("requested", "completed", "failed", "missing")
    if any(counts.get(k) != expected.get(k) for k in keys):
        sys.exit(f"[smoke-k8s] FAILED: local reduce counts {[counts.get(k) for k in keys]} differ from the reducer's "
                 f"{[expected.get(k) for k in keys]} ({keys})")
PY
}

# Sourced (by the tests), it only defines its functions; run, it does the smoke run.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  main "$@"
fi

#!/usr/bin/env bash
# End-to-end smoke run on a kind cluster: MinIO from k8s/overlays/smoke, the chart in testbed
# mode (heuristic policy + synthetic shop), an Indexed Job of 2 shards, then `make reduce` from
# this machine through a port-forward. Fails unless the Job completes and coverage is 1.0.
#
# Needs docker, kind, and the project venv (make install). `make smoke-k8s` builds the image
# and installs Helm first; run this script directly only after that.
#
# Env: KIND_CLUSTER (shopsimrl-smoke)  IMAGE (shopsimrl)  IMAGE_TAG (dev)  NAMESPACE
#      (shopsimrl-smoke)  RELEASE (smoke)  TIMEOUT_S (900)  HELM / KUBECTL (.tools/bin/*)
#      KIND (kind)  PYTHON (.venv/bin/python)  MAKE (make)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

KIND="${KIND:-kind}"
KIND_CLUSTER="${KIND_CLUSTER:-shopsimrl-smoke}"
IMAGE="${IMAGE:-shopsimrl}"
IMAGE_TAG="${IMAGE_TAG:-dev}"
NAMESPACE="${NAMESPACE:-shopsimrl-smoke}"
RELEASE="${RELEASE:-smoke}"
TIMEOUT_S="${TIMEOUT_S:-900}"
HELM="${HELM:-$repo_root/.tools/bin/helm}"
KUBECTL="${KUBECTL:-$repo_root/.tools/bin/kubectl}"
PYTHON="${PYTHON:-$repo_root/.venv/bin/python}"
MAKE="${MAKE:-make}"
CHART="helm/shopsimrl"
CONTEXT="kind-$KIND_CLUSTER"

log() { printf '[smoke-k8s] %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
kc() { "$KUBECTL" --context "$CONTEXT" -n "$NAMESPACE" "$@"; }

for tool in docker "$KIND" "$HELM" "$KUBECTL" "$PYTHON"; do
  command -v "$tool" >/dev/null 2>&1 || die "missing $tool (make install; make helm-bin; install docker and kind)"
done

diagnostics() {
  log "diagnostics for namespace $NAMESPACE"
  kc get jobs,pods,svc -o wide || true
  kc describe jobs -l "app.kubernetes.io/instance=$RELEASE" || true
  for pod in $(kc get pods -l "app.kubernetes.io/instance=$RELEASE" -o name 2>/dev/null); do
    log "logs of $pod"
    kc logs "$pod" --all-containers --tail=80 || true
  done
}

if ! "$KIND" get clusters 2>/dev/null | grep -qx "$KIND_CLUSTER"; then
  log "creating kind cluster $KIND_CLUSTER"
  "$KIND" create cluster --name "$KIND_CLUSTER" --wait 180s
fi
log "loading $IMAGE:$IMAGE_TAG into the cluster"
"$KIND" load docker-image "$IMAGE:$IMAGE_TAG" --name "$KIND_CLUSTER"

log "deploying MinIO (k8s/overlays/smoke)"
"$KUBECTL" --context "$CONTEXT" apply -k k8s/overlays/smoke
kc rollout status deployment/minio --timeout=300s
kc wait --for=condition=Complete job/minio-make-bucket --timeout=300s

log "installing release $RELEASE in testbed mode"
if ! "$HELM" --kube-context "$CONTEXT" upgrade --install "$RELEASE" "$CHART" \
    --namespace "$NAMESPACE" -f "$CHART/ci/testbed-smoke-values.yaml" \
    --set "worker.image.repository=$IMAGE" --set "worker.image.tag=$IMAGE_TAG" \
    --wait --timeout 5m; then
  diagnostics; die "helm install"
fi

selector="app.kubernetes.io/instance=$RELEASE,app.kubernetes.io/component=worker"
job="$(kc get jobs -l "$selector" --sort-by=.metadata.creationTimestamp -o jsonpath='{.items[-1:].metadata.name}')"
[ -n "$job" ] || { diagnostics; die "no worker Job for release $RELEASE"; }
run_uri="$(kc get job "$job" -o jsonpath='{.metadata.annotations.shopsimrl\.io/run-uri}')"
log "waiting for Job $job (run $run_uri), at most ${TIMEOUT_S}s"

# Poll both terminal conditions: `kubectl wait --for=condition=Complete` would sit out the whole
# timeout on a Job that already failed.
deadline=$(( $(date +%s) + TIMEOUT_S ))
state=""
while [ "$(date +%s)" -lt "$deadline" ]; do
  state="$(kc get job "$job" -o jsonpath='{range .status.conditions[?(@.status=="True")]}{.type} {end}')"
  case " $state " in
    *" Complete "*) break ;;
    *" Failed "*) diagnostics; die "Job $job failed (failed indexes: $(kc get job "$job" -o jsonpath='{.status.failedIndexes}'))" ;;
  esac
  sleep 5
done
case " $state " in *" Complete "*) ;; *) diagnostics; die "Job $job did not finish within ${TIMEOUT_S}s" ;; esac
log "Job $job complete: indexes $(kc get job "$job" -o jsonpath='{.status.completedIndexes}')"

# Reduce from this machine, as a user would, through a port-forward to MinIO.
port="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
kc port-forward svc/minio "$port:9000" >/dev/null 2>&1 &
forward_pid=$!
trap 'kill "$forward_pid" 2>/dev/null || true' EXIT
for _ in $(seq 1 30); do
  "$PYTHON" -c "import socket; socket.create_connection(('127.0.0.1', $port), 1)" 2>/dev/null && break
  sleep 1
done

secret_value() { kc get secret minio-credentials -o "jsonpath={.data.$1}" | base64 -d; }
AWS_ACCESS_KEY_ID="$(secret_value MINIO_ROOT_USER)"
AWS_SECRET_ACCESS_KEY="$(secret_value MINIO_ROOT_PASSWORD)"
export AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY
export AWS_ENDPOINT_URL="http://127.0.0.1:$port" AWS_DEFAULT_REGION="us-east-1"

log "make reduce RUN=$run_uri"
"$MAKE" reduce RUN="$run_uri"

"$PYTHON" - "$run_uri" <<'PY'
import json
import sys

import fsspec

uri = sys.argv[1].rstrip("/") + "/summary.json"
with fsspec.open(uri, "rb") as fh:
    summary = json.load(fh)
counts = summary.get("counts", {})
coverage = counts.get("coverage")
print(f"[smoke-k8s] {uri}: completed {counts.get('completed')}/{counts.get('requested')}, coverage {coverage}")
if coverage != 1.0:
    sys.exit(f"[smoke-k8s] FAILED: coverage {coverage} != 1.0")
PY
log "passed"

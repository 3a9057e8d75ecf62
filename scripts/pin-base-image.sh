#!/usr/bin/env bash
# Move the base image of both Dockerfiles (ARG PYTHON_IMAGE=<tag>@sha256:<digest>) to the digest
# its tag points at now: the digest of the tag's multi-platform index, as a registry reports it.
# Run it on a machine that reaches the registry, then rebuild and commit both Dockerfiles. The
# images are only as reproducible as this pin; moving it is a deliberate change (new OS packages).
#
# Usage: scripts/pin-base-image.sh [TAG]    (default: the tag the Dockerfiles pin, e.g. python:3.11-slim)
# Needs one of: docker (with buildx), crane. Env: DOCKER (docker), CRANE (crane).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
files=("$repo_root/Dockerfile" "$repo_root/docker/testbed.Dockerfile")
DOCKER="${DOCKER:-docker}"
CRANE="${CRANE:-crane}"

current="$(sed -n 's/^ARG PYTHON_IMAGE=//p' "${files[0]}")"
for file in "${files[@]}"; do
  pinned="$(sed -n 's/^ARG PYTHON_IMAGE=//p' "$file")"
  [ "$pinned" = "$current" ] || { echo "pin-base-image.sh: $file pins $pinned, ${files[0]} $current" >&2; exit 2; }
done
tag="${1:-${current%@*}}"

if command -v "$CRANE" >/dev/null 2>&1; then
  digest="$("$CRANE" digest "$tag")"
elif command -v "$DOCKER" >/dev/null 2>&1; then
  digest="$("$DOCKER" buildx imagetools inspect "$tag" --format '{{json .Manifest}}' \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["digest"])')"
else
  echo "pin-base-image.sh: needs crane or docker buildx to ask the registry for the digest of $tag" >&2
  exit 2
fi
if ! [[ "$digest" =~ ^sha256:[0-9a-f]{64}$ ]]; then
  echo "pin-base-image.sh: the registry answered '$digest' for $tag, not a sha256 digest" >&2
  exit 1
fi
for file in "${files[@]}"; do
  sed -i "s|^ARG PYTHON_IMAGE=.*|ARG PYTHON_IMAGE=$tag@$digest|" "$file"
done
echo "pin-base-image.sh: $tag@$digest (was $current)" >&2

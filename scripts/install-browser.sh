#!/usr/bin/env bash
# Debian's Chromium and ChromeDriver for the browser tests of the report and the trace viewer
# (tests/research/). Installed with apt-get when missing and when this runs as root; otherwise
# says how, and the browser tests skip (make test sets SHOPSIMRL_BROWSER_REQUIRED=1 only when
# both are present).
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "browser: chromium and chromium-driver are not installed; the browser tests will skip" \
        "(as root on Debian: apt-get install chromium chromium-driver)" >&2
    exit 0
fi
echo "browser: installing Debian's chromium and chromium-driver (about a minute)"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null

#!/usr/bin/env bash
# Debian's Chromium and ChromeDriver for the browser tests of the report and the trace viewer
# (tests/research/), and a CJK font so that the screenshots show the traces' Chinese text.
# Installed with apt-get when missing and when this runs as root; otherwise says how, and the
# browser tests skip (make test sets SHOPSIMRL_BROWSER_REQUIRED=1 only when both are present).
set -euo pipefail
packages=()
command -v chromium >/dev/null || packages+=(chromium)
command -v chromedriver >/dev/null || packages+=(chromium-driver)
dpkg -s fonts-wqy-microhei >/dev/null 2>&1 || packages+=(fonts-wqy-microhei)
if [ "${#packages[@]}" -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "browser: not installed: ${packages[*]}; without chromium and chromium-driver the browser tests skip" \
        "(as root on Debian: apt-get install ${packages[*]})" >&2
    exit 0
fi
echo "browser: installing Debian's ${packages[*]} (about a minute)"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null

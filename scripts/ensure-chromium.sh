#!/usr/bin/env bash
# Make sure a headless Chromium is installed, for the tests that open report.html in a real browser.
#
#   * chromium (or chromium-browser, google-chrome) already on PATH: nothing to do;
#   * root on Debian/Ubuntu: apt-get install chromium (about 15 s);
#   * otherwise: say what to install, exit 3.
set -euo pipefail

log() { printf 'ensure-chromium: %s\n' "$*" >&2; }

for name in chromium chromium-browser google-chrome; do
    command -v "$name" >/dev/null 2>&1 && exit 0
done
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    log "no Chromium found; install it (Debian: apt-get install chromium) for the report's browser tests"
    exit 3
fi
log "installing chromium with apt-get"
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y --no-install-recommends chromium >/dev/null; then
    apt-get update >/dev/null
    apt-get install -y --no-install-recommends chromium >/dev/null
fi
command -v chromium >/dev/null
log "installed $(chromium --version 2>/dev/null || echo chromium)"

#!/bin/sh
# Install one agent runtime at its exact pinned version:
#   install-agent.sh npm PACKAGE VERSION [PREFIX]   (default prefix: the global /usr/local)
#   install-agent.sh pip PACKAGE VERSION VENV
set -eu
kind=$1 package=$2 version=$3 target=${4:-}
case "$kind" in
npm)
    if [ -n "$target" ]; then
        mkdir -p "$target"
        npm install --global --prefix "$target" --no-fund --no-audit --no-update-notifier "$package@$version"
    else
        npm install --global --no-fund --no-audit --no-update-notifier "$package@$version"
    fi
    rm -rf /root/.npm /tmp/*
    ;;
pip)
    # --copies: pvisor canonicalises the entrypoint, and a symlinked venv python resolves to the system one.
    python3 -m venv --copies "$target"
    "$target/bin/pip" install --no-cache-dir --disable-pip-version-check "$package==$version"
    ;;
*)
    echo "pvisor-host: unknown install kind $kind" >&2
    exit 1
    ;;
esac

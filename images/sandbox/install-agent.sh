#!/bin/sh
# Install one agent runtime at its exact pinned version: install-agent.sh KIND PACKAGE VERSION
set -eu
kind=$1 package=$2 version=$3
case "$kind" in
npm)
    npm install --global --no-fund --no-audit --no-update-notifier "$package@$version"
    rm -rf /root/.npm /tmp/*
    ;;
pip)
    python3 -m venv /opt/agent
    /opt/agent/bin/pip install --no-cache-dir --disable-pip-version-check "$package==$version"
    ;;
*)
    echo "pvisor-host: unknown install kind $kind" >&2
    exit 1
    ;;
esac

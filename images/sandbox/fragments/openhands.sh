#!/bin/sh
# OpenHands' local runtime drives commands through tmux; pvisor runs OpenHands with RUNTIME=local.
set -eu
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends tmux git >/dev/null
rm -rf /var/lib/apt/lists/*

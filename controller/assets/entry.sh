#!/bin/sh
# pvisor-host sandbox entry. Variables named with `--env` are handed over in a file readable only by
# the sandbox user, so their values never appear in the container's configuration (`docker inspect`).
set -eu
if [ -r /pvisor-host/input/env.sh ]; then
    set -a
    . /pvisor-host/input/env.sh
    set +a
fi
exec "$@"

#!/bin/sh
# pvisor-host sandbox entry. Variables named with `--env` are handed over in a file readable only by
# the sandbox user, so their values never appear in the container's configuration (`docker inspect`).
set -eu
# The output goes to files in a directory the host made (the engine keeps no logs of a sandbox).
exec >>/pvisor-host/logs/stdout.log 2>>/pvisor-host/logs/stderr.log
# A live continuation reaches its model only through the gateway's socket: relay 127.0.0.1:PORT to it.
if [ -n "${PVISOR_HOST_RELAY:-}" ]; then
    # shellcheck disable=SC2086 # "PORT SOCKET" is two arguments
    "${PVISOR_HOST_RELAY_BIN}" $PVISOR_HOST_RELAY &
fi
if [ -r /pvisor-host/input/env.sh ]; then
    set -a
    . /pvisor-host/input/env.sh
    set +a
fi
exec "$@"

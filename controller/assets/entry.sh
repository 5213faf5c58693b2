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
if [ ! -r /pvisor-host/input/verify.sh ]; then
    exec "$@"
fi
# --verify: pvisor first (its exit code stays the sandbox's), then the task's verifier in the workspace, with
# its own time limit where the image has coreutils' timeout (else the container's wall limit bounds it).
set +e
"$@"
code=$?
clock() { now=$(date +%s.%N 2>/dev/null); case "$now" in *N*|"") date +%s ;; *) echo "$now" ;; esac; }
cd "${PVISOR_HOST_WORKSPACE:-/}" 2>/dev/null || cd /
started=$(clock)
if command -v timeout >/dev/null 2>&1; then
    timeout -k 10 "${PVISOR_HOST_VERIFY_TIMEOUT:-1800}" /bin/sh /pvisor-host/input/verify.sh \
        >/pvisor-host/logs/verify.log 2>&1 </dev/null
else
    /bin/sh /pvisor-host/input/verify.sh >/pvisor-host/logs/verify.log 2>&1 </dev/null
fi
verified=$?
printf '{"exit_code": %d, "started": %s, "ended": %s}\n' "$verified" "$started" "$(clock)" \
    >/pvisor-host/logs/verify.json
exit "$code"

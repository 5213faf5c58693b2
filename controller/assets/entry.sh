#!/bin/sh
# pvisor-host sandbox entry. Variables named with `--env` are handed over in a file readable only by
# the sandbox user, so their values never appear in the container's configuration (`docker inspect`).
set -eu
# The output goes to files in a directory the host made (the engine keeps no logs of a sandbox).
exec >>/pvisor-host/logs/stdout.log 2>>/pvisor-host/logs/stderr.log
# relay "PORT SOCKET": listen on 127.0.0.1:PORT and forward to the host's SOCKET; return once it listens
# (the first replayed call may come at once), judged by /proc/net/tcp, as no tool is sure to be there.
relay() {
    # shellcheck disable=SC2086 # "PORT SOCKET" is two arguments
    "${PVISOR_HOST_RELAY_BIN}" $1 &
    listening=$(printf '0100007F:%04X 00000000:0000 0A' "${1%% *}")
    waited=0 # hundredths of a second, at most 3 s
    while [ "$waited" -lt 300 ]; do
        while IFS= read -r line; do
            case "$line" in *"$listening"*) return 0 ;; esac
        done </proc/net/tcp
        if sleep 0.01 2>/dev/null; then waited=$((waited + 1)); else sleep 1; waited=$((waited + 100)); fi
    done
    echo "pvisor-host: the relay on 127.0.0.1:${1%% *} is not listening after 3 s; going on" >&2
}
# A live continuation reaches its model only through the gateway's socket: relay 127.0.0.1:PORT to it.
if [ -n "${PVISOR_HOST_RELAY:-}" ]; then
    relay "$PVISOR_HOST_RELAY"
fi
# --egress: the replayed tools' proxy (http_proxy and friends) is 127.0.0.1:PORT, relayed to the host's
# egress proxy through the run's own socket; the sandbox has no network of its own.
if [ -n "${PVISOR_HOST_EGRESS_RELAY:-}" ]; then
    relay "$PVISOR_HOST_EGRESS_RELAY"
fi
if [ ! -r /pvisor-host/input/verify.sh ]; then
    if [ -r /pvisor-host/input/env.sh ]; then
        set -a
        . /pvisor-host/input/env.sh
        set +a
    fi
    exec "$@"
fi
# --verify (see pvisor_host/backend/docker/sandbox/verify.py). pvisor first, with the --env values; then,
# with nothing of the replay left running and none of its values in the environment, the task's verifier,
# once the host has collected the workspace as pvisor left it. The sandbox's exit code is the verifier's.
set +e
(
    if [ -r /pvisor-host/input/env.sh ]; then
        set -a
        . /pvisor-host/input/env.sh
        set +a
    fi
    exec "$@"
)
code=$?
printf '{"exit_code": %d}\n' "$code" >/pvisor-host/logs/pvisor.json
kill -KILL -1 2>/dev/null  # every process but this shell and init: the agent's leftovers, the relay
rm -rf /logs/verifier/* /logs/verifier/.[!.]* 2>/dev/null
waited=0
until [ -e /pvisor-host/input/verify.go ]; do
    sleep 0.1 2>/dev/null || sleep 1
    waited=$((waited + 1))
    [ "$waited" -lt 36000 ] || exit 125  # no word from the host: it is gone
done
cd "${PVISOR_HOST_WORKSPACE:-/}" 2>/dev/null || cd /
exec /bin/sh /pvisor-host/input/verify.sh >/pvisor-host/logs/verify.log 2>&1 </dev/null

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
# bounded SECONDS WHAT COMMAND...: run COMMAND, and end it, with everything else of the sandbox, once it has run
# SECONDS, whether or not the host is there to end it (a controller killed with kill -9 leaves nobody else):
# the sandbox's own deadline, the host's --timeout plus a grace. Its exit code is COMMAND's, 124 at the deadline,
# which /pvisor-host/logs/deadline.json (made empty by the host, writable by the sandbox user) then names.
bounded() {
    seconds=$1 what=$2
    shift 2
    "$@" &
    pid=$!
    (
        sleep "$seconds"
        printf '{"deadline": %s, "what": "%s"}\n' "$seconds" "$what" >/pvisor-host/logs/deadline.json
        kill -TERM "$pid" 2>/dev/null
        sleep 5
        kill -KILL "$pid" 2>/dev/null # this shell then exits 124, and the container with every process in it
    ) &
    watchdog=$!
    code=0
    wait "$pid" || code=$?
    kill "$watchdog" 2>/dev/null || true
    if [ -s /pvisor-host/logs/deadline.json ]; then
        return 124
    fi
    return "$code"
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
# shellcheck disable=SC2329 # invoked through bounded
replay() {
    if [ -r /pvisor-host/input/env.sh ]; then
        set -a
        . /pvisor-host/input/env.sh
        set +a
    fi
    exec "$@"
}
if [ ! -r /pvisor-host/input/verify.sh ]; then
    set +e
    bounded "${PVISOR_HOST_DEADLINE:-86400}" replay replay "$@"
    exit $?
fi
# --verify (see pvisor_host/backend/docker/sandbox/verify.py). pvisor first, with the --env values; then,
# with nothing of the replay left running and none of its values in the environment, the task's verifier,
# once the host has collected the workspace as pvisor left it. The sandbox's exit code is the verifier's.
set +e
bounded "${PVISOR_HOST_DEADLINE:-86400}" replay replay "$@"
code=$?
[ "$code" -ne 124 ] || [ ! -s /pvisor-host/logs/deadline.json ] || exit 124
printf '{"exit_code": %d}\n' "$code" >/pvisor-host/logs/pvisor.json
kill -KILL -1 2>/dev/null  # every process but this shell and init: the agent's leftovers, the relay
rm -rf /logs/verifier/* /logs/verifier/.[!.]* 2>/dev/null
waited=0 # tenths of a second: the host collects the workspace, then says go; it is gone if it does not
until [ -e /pvisor-host/input/verify.go ]; do
    sleep 0.1 2>/dev/null || sleep 1
    waited=$((waited + 1))
    [ "$waited" -lt "${PVISOR_HOST_GO_AHEAD:-3000}" ] || exit 125
done
cd "${PVISOR_HOST_WORKSPACE:-/}" 2>/dev/null || cd /
bounded "${PVISOR_HOST_VERIFY_DEADLINE:-86400}" verifier /bin/sh /pvisor-host/input/verify.sh >/pvisor-host/logs/verify.log 2>&1 </dev/null
exit $?

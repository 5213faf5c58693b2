#!/usr/bin/env bash
# Make sure a Docker engine answers, for `make demo` and `make test` on a fresh machine.
#
#   * an engine already answers at $DOCKER_HOST (or the default socket): nothing to do;
#   * root on Debian/Ubuntu: install docker.io and mmdebstrap with apt when missing, and start a plain
#     `dockerd` in the background; never a second dockerd (and never one with --bridge=none);
#   * otherwise: say what to install, exit 3.
#
# mmdebstrap is what pvisor-host uses to bootstrap a base image when no registry is reachable.
set -euo pipefail

log() { printf 'ensure-engine: %s\n' "$*" >&2; }

ping_engine() {
    python3 - "${DOCKER_HOST:-unix:///var/run/docker.sock}" <<'PY'
import http.client, socket, sys
address = sys.argv[1]
class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=3)
        self.path = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(3)
        self.sock.connect(self.path)
try:
    if address.startswith("unix://"):
        connection = UnixConnection(address[len("unix://"):])
    elif address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].partition(":")
        connection = http.client.HTTPConnection(host, int(port or 2375), timeout=3)
    else:
        sys.exit(2)
    connection.request("GET", "/_ping")
    sys.exit(0 if connection.getresponse().status == 200 else 1)
except OSError:
    sys.exit(1)
PY
}

can_install=no
if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    can_install=yes
fi

need=()
if ! ping_engine; then
    command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
fi
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
if ((${#need[@]})) && [[ $can_install == yes ]]; then
    log "installing ${need[*]} with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if ping_engine; then
    exit 0
fi

if [[ -n "${DOCKER_HOST:-}" && "${DOCKER_HOST}" != "unix:///var/run/docker.sock" ]]; then
    log "no Docker engine answers at DOCKER_HOST=${DOCKER_HOST}; start it or unset DOCKER_HOST"
    exit 3
fi

if [[ $can_install != yes ]]; then
    log "no Docker engine answers at /var/run/docker.sock."
    log "install Docker Engine (https://docs.docker.com/engine/install/) and start it, or set DOCKER_HOST;"
    log "on Debian as root this script installs it itself (apt-get install docker.io mmdebstrap)."
    exit 3
fi

if pgrep -x dockerd >/dev/null 2>&1; then
    log "a dockerd is already running; waiting for it to answer (never starting a second one)"
else
    # A stale pidfile from a killed daemon makes dockerd refuse to start.
    rm -f /var/run/docker.pid
    log "starting dockerd in the background (log: /var/log/pvisor-host-dockerd.log)"
    setsid nohup dockerd --log-level=warn >/var/log/pvisor-host-dockerd.log 2>&1 </dev/null &
fi

for _ in $(seq 1 300); do
    if ping_engine; then
        log "Docker engine is up"
        exit 0
    fi
    sleep 0.1
done
log "dockerd did not answer within 30 s; its log follows"
tail -n 30 /var/log/pvisor-host-dockerd.log >&2 || true
exit 3

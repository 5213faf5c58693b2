#!/usr/bin/env bash
# Make sure a Docker engine answers, for `make demo` and `make test` on a fresh machine.
#
#   * an engine already answers at $DOCKER_HOST (or the default socket): nothing to do;
#   * root on Debian/Ubuntu: install docker.io and mmdebstrap with apt when missing, and start a plain
#     `dockerd` in the background; never a second dockerd (and never one with --bridge=none);
#   * otherwise: say what to install, exit 3.
#
# With --with-runsc (make test), gVisor's runsc is installed too and registered as the engine's runtime
# "runsc" — but only for an engine this script starts, or started earlier (its pid is in $PIDFILE), and only
# when /etc/docker/daemon.json is absent or was written by this script: a daemon configuration someone else
# owns is never rewritten. A running engine of ours picks the runtimes up on SIGHUP.
#
# The same goes for the fork runtime (`--fork`, docs/fork.md): Debian 13's gVisor 0.0~20240729 (Debian 12's
# cannot save a sandbox at the boundary), fetched from Debian's archive by its pinned sha256 into $FORK_DIR and
# registered as "runsc-fork", with the engine's experimental mode on (Docker 20.10 restores a checkpoint only
# then). Experimental mode is not reloaded on SIGHUP: an engine of ours that runs without it is told how to restart
# (it may be busy: this script never restarts an engine).
#
# mmdebstrap is what pvisor-host uses to bootstrap a base image when no registry is reachable.
set -euo pipefail

WITH_RUNSC=no
[[ "${1:-}" == "--with-runsc" ]] && WITH_RUNSC=yes
PIDFILE=/var/run/pvisor-host-dockerd.pid
DAEMON_JSON=/etc/docker/daemon.json
OURS=/etc/docker/.pvisor-host-wrote-daemon.json
RUNSC_ARGS='["--network=none", "--host-uds=open"]'
FORK_DIR=/usr/local/lib/pvisor-host/gvisor-20240729
FORK_DEB=runsc_0.0~20240729.0-4+b7_amd64.deb
FORK_URL="https://deb.debian.org/debian/pool/main/g/golang-gvisor-gvisor/${FORK_DEB//\~/%7E}"
FORK_SHA256=3c25a5130dfac2f71237d5baad56ac86a255de87a0400f11b36a555156dc325a

log() { printf 'ensure-engine: %s\n' "$*" >&2; }

# GET $1 from the engine's API; prints the body, exits non-zero when no engine answers.
engine_get() {
    python3 - "${DOCKER_HOST:-unix:///var/run/docker.sock}" "$1" <<'PY'
import http.client, socket, sys
address, path = sys.argv[1], sys.argv[2]
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
    connection.request("GET", path)
    response = connection.getresponse()
    sys.stdout.write(response.read().decode())
    sys.exit(0 if response.status == 200 else 1)
except OSError:
    sys.exit(1)
PY
}

ping_engine() { engine_get /_ping >/dev/null; }

# Whether the engine has gVisor registered as "runsc" (and, when the fork runtime is installed, "runsc-fork" with
# experimental mode on).
runsc_registered() {
    engine_get /info | python3 -c '
import json, os, sys
info = json.load(sys.stdin)
runtimes = info.get("Runtimes", {})
fork = os.path.exists(sys.argv[1])
sys.exit("runsc" not in runtimes or (fork and ("runsc-fork" not in runtimes or not info.get("ExperimentalBuild"))))
' "$FORK_DIR/runsc"
}

# Debian 13's runsc, by its pinned sha256, into $FORK_DIR (a static binary: nothing else of trixie comes along).
install_fork_runsc() {
    [[ -x $FORK_DIR/runsc ]] && return 0
    local tmp
    tmp=$(mktemp -d)
    log "fetching the fork runtime (gVisor 0.0~20240729, Debian 13's $FORK_DEB)"
    if curl -fsSL --retry 3 --max-time 300 -o "$tmp/$FORK_DEB" "$FORK_URL" &&
        echo "$FORK_SHA256  $tmp/$FORK_DEB" | sha256sum -c --quiet - &&
        dpkg-deb -x "$tmp/$FORK_DEB" "$tmp/x" && mkdir -p "$FORK_DIR" &&
        install -m 0755 "$tmp/x/usr/bin/runsc" "$FORK_DIR/runsc.new" && mv "$FORK_DIR/runsc.new" "$FORK_DIR/runsc"; then
        log "installed $FORK_DIR/runsc"
    else
        log "could not install $FORK_URL (sha256 $FORK_SHA256): --fork will be refused on this engine"
    fi
    rm -rf "$tmp"
}

# The dockerd processes of this machine itself: not those running inside containers (a cluster test's nodes
# run their own engines), whose cgroup names their container.
host_dockerds() {
    local pid
    for pid in $(pgrep -x dockerd || true); do
        grep -qE 'docker[-/][0-9a-f]{64}' "/proc/$pid/cgroup" 2>/dev/null || echo "$pid"
    done
}

ours_running() {
    [[ -f $PIDFILE ]] && [[ -n "$(cat "$PIDFILE")" ]] && [[ "$(host_dockerds)" == "$(cat "$PIDFILE")" ]]
}

# Write the runsc runtime into daemon.json when the file is ours to write; true when it now holds it.
register_runsc() {
    if [[ -f $DAEMON_JSON && ! -f $OURS ]]; then
        log "$DAEMON_JSON belongs to someone else: not registering runsc (see docs/security.md#gvisor)"
        return 1
    fi
    mkdir -p "$(dirname "$DAEMON_JSON")"
    local fork=""
    if [[ -x $FORK_DIR/runsc ]]; then
        fork=$(printf ', "runsc-fork": {"path": "%s", "runtimeArgs": %s}' "$FORK_DIR/runsc" "$RUNSC_ARGS")
    fi
    printf '{"experimental": %s, "runtimes": {"runsc": {"path": "%s", "runtimeArgs": %s}%s}}\n' \
        "$([[ -n $fork ]] && echo true || echo false)" "$(command -v runsc)" "$RUNSC_ARGS" "$fork" >"$DAEMON_JSON" ||
        return 1
    touch "$OURS" || return 1
    log "registered gVisor (runsc $(runsc --version | head -n 1 | awk '{print $3}')) in $DAEMON_JSON"
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
if [[ $WITH_RUNSC == yes ]] && ! command -v runsc >/dev/null 2>&1 && { ! ping_engine || ours_running; }; then
    need+=(runsc)
fi
if ((${#need[@]})) && [[ $can_install == yes ]]; then
    log "installing ${need[*]} with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if [[ $WITH_RUNSC == yes && $can_install == yes ]] && { ! ping_engine || ours_running; }; then
    install_fork_runsc
fi

if ping_engine; then
    if [[ $WITH_RUNSC == yes ]] && ours_running && command -v runsc >/dev/null 2>&1 && ! runsc_registered; then
        register_runsc || exit 0
        kill -HUP "$(cat "$PIDFILE")" && sleep 1
        if runsc_registered; then
            log "runsc is registered"
        else  # experimental mode (for --fork) is read at the engine's start only; it may be busy: never restarted
            log "restart the engine to turn on experimental mode for --fork: pid=\$(cat $PIDFILE); kill \$pid;" \
                "while kill -0 \$pid 2>/dev/null; do sleep 0.2; done; $0 --with-runsc"
        fi
        exit 0
    else
        exit 0
    fi
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

if [[ -n "$(host_dockerds)" ]]; then
    log "a dockerd is already running; waiting for it to answer (never starting a second one)"
else
    if [[ $WITH_RUNSC == yes ]] && command -v runsc >/dev/null 2>&1; then
        register_runsc || true
    fi
    # A stale pidfile from a killed daemon makes dockerd refuse to start.
    rm -f /var/run/docker.pid
    log "starting dockerd in the background (log: /var/log/pvisor-host-dockerd.log)"
    setsid nohup dockerd --log-level=warn >/var/log/pvisor-host-dockerd.log 2>&1 </dev/null &
    echo $! >"$PIDFILE"
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

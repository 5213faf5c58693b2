#!/bin/sh
# Make sure the base image has what pvisor replay and the agents need: bash (Claude's Bash tool),
# /bin/sh, python3 with venv (pvisor install, OpenCode's rescue path), CA certificates and libstdc++
# (node). Installs the missing ones with apt-get when the base has it; the bootstrapped base has all.
set -eu
missing=""
command -v bash >/dev/null 2>&1 || missing="$missing bash"
command -v python3 >/dev/null 2>&1 || missing="$missing python3 python3-venv"
if command -v python3 >/dev/null 2>&1 && ! python3 -m venv --without-pip /tmp/.venv-probe >/dev/null 2>&1; then
    missing="$missing python3-venv"
fi
rm -rf /tmp/.venv-probe
[ -e /etc/ssl/certs/ca-certificates.crt ] || missing="$missing ca-certificates"
have_libstdcxx=no
for lib in /usr/lib/*-linux-gnu/libstdc++.so.6 /usr/lib/libstdc++.so.6 /lib/*-linux-gnu/libstdc++.so.6; do
    [ -e "$lib" ] && have_libstdcxx=yes
done
[ "$have_libstdcxx" = yes ] || missing="$missing libstdc++6"
if [ -z "$missing" ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "pvisor-host: the base image lacks:$missing and has no apt-get to install them" >&2
    exit 1
fi
echo "pvisor-host: installing$missing" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
rm -rf /var/lib/apt/lists/*

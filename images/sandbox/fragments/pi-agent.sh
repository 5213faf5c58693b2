#!/bin/sh
# Lay out the Pi runtime the way pvisor expects it: <root>/bin/pi, <root>/node/bin/node and
# <root>/npm-global/lib/node_modules/@earendil-works/pi-coding-agent (pvisor derives the root from the
# entrypoint). bin/pi is a relocatable wrapper, so the same tree also works when injected elsewhere.
set -eu
root=/opt/pi-agent
mkdir -p "$root/node/bin" "$root/bin"
cp /usr/local/bin/node "$root/node/bin/node"
cat > "$root/bin/pi" <<'WRAPPER'
#!/bin/sh
root=$(cd "$(dirname "$0")/.." && pwd)
exec "$root/node/bin/node" "$root/npm-global/lib/node_modules/@earendil-works/pi-coding-agent/dist/cli.js" "$@"
WRAPPER
chmod 755 "$root/bin/pi"
chmod -R go-w "$root"

#!/bin/sh
# Run a build step with the build-time CA bundle (from `--ca-bundle`) when one was given, so pip, npm
# and python reach their registries behind a TLS-intercepting proxy.
ca=/usr/local/share/pvisor-host/build-ca.pem
if [ -s "$ca" ]; then
    export SSL_CERT_FILE="$ca" PIP_CERT="$ca" REQUESTS_CA_BUNDLE="$ca" NODE_EXTRA_CA_CERTS="$ca"
fi
exec "$@"

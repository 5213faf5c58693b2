#!/bin/sh
# mini-swe-agent's own defaults, as JSON beside its venv: the `mini` CLI's configurations (config/mini.yaml for
# tool-calling models, config/mini_textbased.yaml for text-based ones). pvisor-host fills what a saved trajectory's
# config lacks from them (its agent templates), so that pvisor's runner can build the agent (docs/agents.md).
set -eu
/opt/mini-swe-agent/bin/python - <<'PY'
import importlib.util, json, pathlib, yaml
root = pathlib.Path(importlib.util.find_spec("minisweagent").submodule_search_locations[0]) / "config"
defaults = {name: yaml.safe_load((root / name).read_text()) for name in ("mini.yaml", "mini_textbased.yaml")}
pathlib.Path("/opt/mini-swe-agent/pvisor-host-defaults.json").write_text(json.dumps(defaults, indent=1))
PY

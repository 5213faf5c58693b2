"""A native trajectory as the sandbox reads it: what its saved config lacks and the agent's runner needs, filled
with the agent's own defaults (mini-swe-agent).

pvisor's mini-swe-agent runner builds the agent from the trajectory's saved ``info.config``, and mini-swe-agent
2.4.6's ``AgentConfig`` requires its two templates. A trajectory saved without them (pvisor's own synthetic
ones are) would fail before its first replayed call with a pydantic ``ValidationError``. The sandbox's copy gets
them from the agent's own default configuration (``[trajectory] config_defaults`` in its profile); the record
keeps the original's sha256, names what was filled and the copy's sha256.
"""

from __future__ import annotations

from typing import Any

#: What pvisor's mini-swe-agent runner needs of a saved ``info.config`` and mini-swe-agent 2.4.6 does not
#: default: the agent's two templates (``AgentConfig``'s required fields). The runner never renders them (it
#: rebuilds the agent's messages from the trajectory), so filling them changes nothing the replay does.
_REQUIRED_AGENT_KEYS = ("system_template", "instance_template")


def fill_config(document: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    """Fill what a mini-swe-agent trajectory's saved config lacks from the agent's own ``defaults`` (its
    ``mini.yaml``, or ``mini_textbased.yaml`` for a text-based model), in place. Values the trajectory has
    always win. Returns the dotted keys it filled (none: the document is unchanged)."""
    info = document.get("info")
    if not isinstance(info, dict):
        return []
    config = info.setdefault("config", {})
    if not isinstance(config, dict):
        return []
    filled: list[str] = []
    for section in ("model", "environment", "agent"):
        if not isinstance(config.get(section), dict):
            config[section] = {}
            filled.append(f"info.config.{section}")
    textbased = str(config.get("model_type") or config["model"].get("model_class") or "").endswith("TextbasedModel")
    source = defaults.get("mini_textbased.yaml" if textbased else "mini.yaml") or {}
    agent_defaults = source.get("agent") if isinstance(source, dict) else None
    for key in _REQUIRED_AGENT_KEYS:
        if key not in config["agent"] and isinstance(agent_defaults, dict) and key in agent_defaults:
            config["agent"][key] = agent_defaults[key]
            filled.append(f"info.config.agent.{key}")
    return filled

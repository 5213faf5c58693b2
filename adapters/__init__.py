"""Declarative agent profiles: one ``<agent>.toml`` per agent pvisor replays (see ``docs/agents.md``).

This package holds data only; :mod:`pvisor_host.profiles` validates and loads it.
"""

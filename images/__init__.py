"""Image recipes: Dockerfiles, their helper scripts and pinned runtimes (see ``docs/images.md``).

This package holds data only; :mod:`pvisor_host.build` renders and builds it.
"""

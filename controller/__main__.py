"""``python -m pvisor_host`` runs the CLI."""

from .entry import main

main()

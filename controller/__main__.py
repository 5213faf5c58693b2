"""``python -m pvisor_host`` runs the CLI."""

from .cli import main

main()

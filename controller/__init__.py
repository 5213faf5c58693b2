"""pvisor-host: replay recorded AI-agent trajectories with pvisor inside hardened Docker containers.

The library never configures logging sinks: it logs through loguru under the ``pvisor_host`` name,
which stays disabled until the CLI (or the embedding application) enables it.
"""

from loguru import logger

from ._version import PVISOR_VERSION, __version__

logger.disable("pvisor_host")

__all__ = ["PVISOR_VERSION", "__version__"]

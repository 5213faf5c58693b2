"""The library's logger: loguru's, with ``pvisor_host``'s records off until the CLI (or an embedding
application, ``logger.enable("pvisor_host")``) turns them on. The package imports this module first, so the
records are off before anything can turn them on, and every module logs through it."""

from loguru import logger

logger.disable("pvisor_host")

__all__ = ["logger"]

"""The library's logger: loguru's, with ``pvisor_host``'s records off until the CLI (or an embedding
application, ``logger.enable("pvisor_host")``) turns them on.

loguru is imported with the first module that logs, not with the package (``pvisor-host --help`` needs no
logger). So by then an application may already have said what it wants of our records: this module turns
them off only when nobody has (loguru keeps what ``enable``/``disable`` were told, per name, in its
activation list; there is no public way to read it, and loguru is pinned below 1.0). When loguru is loaded
before the package is, the package imports this module at once, as before.
"""

from loguru import logger

_NAME = "pvisor_host."


def _told() -> bool:
    """Whether ``enable``/``disable`` was called for our records (or for a name that covers them)."""
    activations = getattr(getattr(logger, "_core", None), "activation_list", None)
    return isinstance(activations, list) and any(_NAME.startswith(str(name)) for name, _ in activations)


if not _told():
    logger.disable("pvisor_host")

__all__ = ["logger"]

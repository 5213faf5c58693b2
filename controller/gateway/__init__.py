"""The model gateway, engine-neutral: the only holder of the real key, and the sandbox's only way to its model.

:class:`~.proxy.ModelProxy` accepts a sandbox's model calls with a per-run token, forwards them to the upstream
with the real key over pooled connections, passes answers (streams included) through as they arrive, and
journals every exchange (:mod:`.journal`). Where it listens, and how a sandbox reaches that, is the
backend's business (``backend/docker/gateway.py``: a unix socket mounted into a sandbox without a network,
or an internal Docker network).
"""

from .proxy import ModelProxy

__all__ = ["ModelProxy"]

"""The model gateway, engine-neutral: the only holder of the real key, and the sandbox's only way to its model.

:class:`~.proxy.ModelProxy` accepts a sandbox's model calls with a per-run token, forwards them to the upstream
with the real key over pooled connections (:mod:`.upstream`: within the batch's limits, :mod:`.limits`, and
retried while nothing has reached the agent), passes answers (streams included) through as they arrive, and
journals every exchange (:mod:`.journal`); a cassette (:mod:`.cassette`) keeps a run's exchanges or serves them
back. Where it listens, and how a sandbox reaches that, is the backend's business (``backend/docker/gateway.py``:
a unix socket mounted into a sandbox without a network, or an internal Docker network).

Nothing is imported here: the journal's totals are read without loading an HTTP library.
"""

"""The cluster backend: replays spread over the Docker hosts of a Ray cluster (the ``ray`` extra).

:mod:`.connect` imports Ray and joins a cluster (token authentication on), :mod:`.join` makes a Docker host
a node (``pvisor-host node join``), :mod:`.node` holds the Ray tasks that run on the nodes, :mod:`.ship`
gets images to them, :mod:`.ledger` records where each copy of an attempt runs, and :mod:`.backend` is the
driver's side of the backend seam (``batch --cluster``). Nothing here is imported unless a cluster is used.
"""

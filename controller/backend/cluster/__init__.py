"""The cluster backend: replays spread over the Docker hosts of a Ray cluster (the ``ray`` extra).

The driver's side: :mod:`.backend` (the seam, ``batch --cluster``), :mod:`.copies` (the copies of one attempt
and the watchdog over them), :mod:`.ledger` (where each copy runs), :mod:`.ship` (images to the nodes) and
:mod:`.connect` (Ray, the token, one connection per process). The node's side, :mod:`.node`: the Ray tasks that
run there (:mod:`.node.tasks`), ``node join`` (:mod:`.node.join`) and ``cluster status`` (:mod:`.node.status`).

Nothing here imports docker: engines are reached through :class:`~pvisor_host.backend.docker.DockerBackend`
and its image API. Nothing here is imported unless a cluster is used.
"""

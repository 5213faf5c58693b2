"""The local Docker engine as a backend: the only package of pvisor-host that imports docker.

Its sub-packages are the lifecycle stages of a sandbox, in the order a replay meets them:
:mod:`.build` (the image), :mod:`.sandbox` (stage, launch, run, collect, record), :mod:`.gateway`
(the model gateway), :mod:`.cleanup` (gc, images); :mod:`.engine` connects and maps the engine's errors.
"""

from .backend import DockerBackend

__all__ = ["DockerBackend"]

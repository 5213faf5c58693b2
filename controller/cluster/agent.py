"""The part of a cluster run that lives on a node: one :class:`NodeAgent` (a Ray actor) per Docker host.

An agent runs attempts with the node's own :class:`~pvisor_host.backend.docker.DockerBackend` — the same
single-host pipeline as a local run: staging, the hardened sandbox, collection, the record — in a scratch
directory of the node, then serves the attempt's run directory back as a tar, in chunks the driver asks
for, so neither side ever holds a whole tree in memory. Images arrive the same way (``docker save`` on the
driver, chunks, ``docker load`` here) and are loaded at most once, checked by id.

The model key of a live continuation reaches the agent as an argument of :meth:`NodeAgent.run`, over the
cluster's authenticated channel; the agent's own gateway holds it, and it never enters a container.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import tarfile
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import Interrupted, PvisorHostError
from ..models.replay import Attempt, PreparedReplay

#: Bytes per chunk of a run directory or an image on its way between driver and node.
CHUNK = 8 * 1024 * 1024


class NodeAgent:
    """Runs attempts on this node's engine and serves their run directories (made a Ray actor by the driver).

    Every method returns plain data; a failure comes back as ``{"error": {...}}`` naming the exception's
    class and exit code, so that the driver raises the same kind of error a local run would.
    """

    def __init__(self, session: str) -> None:
        from ..backend.docker import DockerBackend
        from ..models.ownership import Ownership

        self.backend = DockerBackend.connect(Ownership.current(session=session), pool_size=16)
        self.node = socket.gethostname()
        self.root = Path(tempfile.mkdtemp(prefix="pvisor-host-node-"))
        self._uploads: dict[str, Path] = {}
        self._runs: dict[str, Path] = {}
        self._lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        """This node: its host name and pvisor-host version."""
        return {"node": self.node, "version": __version__}

    def status(self) -> dict[str, Any]:
        """This node for ``cluster status``: engine version, pvisor-host images, sandboxes of ours running."""
        client = self.backend.client
        try:
            engine = str(client.version().get("Version", "?"))
            images = sorted(
                tag for image in client.images.list(filters={"label": "pvisor-host.agent"}) for tag in image.tags
            )
            running = len(client.containers.list(filters={"label": "pvisor-host.role=replay"}, sparse=True))
        except Exception as exc:  # noqa: BLE001 - reported, not raised: status shows every node it can
            return {**self.info(), "engine": f"error: {exc}", "images": [], "running": 0}
        return {**self.info(), "engine": engine, "images": images, "running": running}

    # -- images ---------------------------------------------------------------------------------------------

    def has_image(self, image_id: str) -> bool:
        """Whether the engine has the image with this id (a ``docker load`` keeps ids)."""
        import docker.errors

        try:
            self.backend.client.images.get(image_id)
        except docker.errors.ImageNotFound:
            return False
        return True

    def upload(self, token: str, chunk: bytes) -> int:
        """Append a chunk to upload ``token`` (an image tar on its way); the bytes received so far."""
        path = self._uploads.setdefault(token, self.root / f"upload-{uuid.uuid4().hex}")
        with path.open("ab") as handle:
            handle.write(chunk)
        return path.stat().st_size

    def load_image(self, token: str, image_id: str) -> dict[str, Any]:
        """``docker load`` the finished upload ``token``, check the image id, and drop the upload."""
        path = self._uploads.pop(token)
        try:
            with self._lock, path.open("rb") as handle:
                self.backend.client.images.load(handle)
            if not self.has_image(image_id):
                return _error("InfrastructureError", f"{self.node}: the image loaded is not {image_id[:19]}")
            return {"loaded": image_id}
        except Exception as exc:  # noqa: BLE001 - the driver needs a message, not a traceback from here
            return _error("InfrastructureError", f"{self.node}: docker load failed: {exc}")
        finally:
            path.unlink(missing_ok=True)

    # -- attempts -------------------------------------------------------------------------------------------

    def run(
        self,
        prepared_json: str,
        attempt_number: int,
        run_id: str,
        trajectory: bytes,
        workspace: bytes | None,
        key: str | None,
    ) -> dict[str, Any]:
        """Run one attempt here; its run directory stays on this node until :meth:`drop`.

        Returns ``{"token", "interrupted"}`` (the record is in the run directory :meth:`read` serves), or
        ``{"error": ...}``.
        """
        token = uuid.uuid4().hex
        base = self.root / token
        (base / "input").mkdir(parents=True)
        prepared = PreparedReplay.model_validate_json(prepared_json)
        source = base / "input" / prepared.trajectory.path.name
        source.write_bytes(trajectory)
        spec = prepared.spec
        if workspace is not None:
            with tarfile.open(fileobj=io.BytesIO(workspace), mode="r:") as archive:
                archive.extractall(base / "workspace", filter="data")
            spec = spec.model_copy(update={"workspace_dir": base / "workspace"})
        local = prepared.model_copy(
            update={
                "spec": spec,
                "trajectory": prepared.trajectory.model_copy(update={"path": source}),
                "out_dir": base / "run",
            }
        )
        attempt = Attempt(number=attempt_number, run_id=run_id, run_dir=base / "run")
        gateway = None
        interrupted = False
        try:
            if spec.continuation is not None and key is not None:
                gateway = self._gateway(spec.continuation, key, prepared.user)
            self.backend.run_attempt(local, attempt, gateway=gateway)
        except Interrupted:
            interrupted = True
        except PvisorHostError as exc:
            shutil.rmtree(base, ignore_errors=True)
            return _error(type(exc).__name__, exc.one_line(), exit_code=int(exc.exit_code))
        except Exception as exc:  # noqa: BLE001
            shutil.rmtree(base, ignore_errors=True)
            return _error("InfrastructureError", f"{self.node}: {exc!r}")
        finally:
            if gateway is not None:
                gateway.close()
        self._runs[token] = base
        return {"token": token, "interrupted": interrupted}  # the record is in the run directory

    def _gateway(self, upstream: Any, key: str, user: str) -> Any:
        # The gateway reads the key from the variable the user named; set it only while the gateway starts.
        with self._lock:
            os.environ[upstream.api_key_env] = key
            try:
                return self.backend.open_gateway(upstream, user=user)
            finally:
                del os.environ[upstream.api_key_env]

    def read(self, token: str, offset: int) -> bytes:
        """The next chunk (from ``offset``) of the attempt's run directory as a tar; ``b""`` at the end."""
        base = self._runs[token]
        archive = base / "run.tar"
        if offset == 0 and not archive.exists():
            with tarfile.open(archive, "w") as tar:
                tar.add(base / "run", arcname="run")
        with archive.open("rb") as handle:
            handle.seek(offset)
            return handle.read(CHUNK)

    def drop(self, token: str) -> None:
        """Remove what attempt ``token`` left on this node."""
        base = self._runs.pop(token, None)
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)

    def cancel(self) -> None:
        """Stop every sandbox this agent runs (their attempts end ``interrupted``)."""
        self.backend.cancel()

    def close(self) -> None:
        """Remove the scratch directory and release the engine connection."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.backend.close()


def _error(kind: str, message: str, *, exit_code: int | None = None) -> dict[str, Any]:
    return {"error": {"type": kind, "message": message, "exit_code": exit_code}}

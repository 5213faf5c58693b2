"""A real Ray cluster of Docker hosts on this one machine, for tests (after ``../shared/reference/cluster.md``).

* The **head** is ``ray start --head`` on this host, bound to the ``docker0`` gateway, token auth on.
* Each **node** is a container running its own ``dockerd`` and then ``pvisor-host node join`` — the real
  command — so that its replays run against its own engine. Nodes get the capabilities a nested engine
  needs (not ``--privileged``, which this VM refuses).
* The **node image** is Debian bookworm (mmdebstrap, no registry) with ``docker.io``, this interpreter
  copied to the same path (Ray needs the driver's exact Python; Debian's 3.11.2 also lacks
  ``tarfile.data_filter``) and a venv with pvisor-host's dependencies and Ray from an offline wheelhouse.
  pvisor-host's own source is bind-mounted read-only and copied in at start, so a code change needs no
  rebuild. The
  image is tagged by a hash of what goes into it and built once per machine (about 80 s).

The cluster token is handed to nodes in a file (never in their command line or environment), and the head
is stopped by its own process ids (``ray stop`` would kill every Ray process of the machine, nodes' too).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

from conftest import run_cli
from trajgen import Call, Turn, claude_session, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
RAY = "ray==2.60.0"
NODE_LABEL = "pvisor-host.test-node"
NODE_PACKAGES = "docker.io,iptables,procps,ca-certificates,python3,socat,docker-registry"
NODE_START = r"""#!/bin/sh
# A test node: its own dockerd, then `pvisor-host node join` (the container's main process).
set -e
for m in $(awk '$3=="cgroup"||$3=="cgroup2"{print $2}' /proc/mounts); do
    mount -o remount,bind,rw "$m" 2>/dev/null || true
done
mount -o remount,rw /sys/fs/cgroup 2>/dev/null || true
rm -rf /run/docker /run/docker.pid /run/docker.sock /run/containerd
# a test registry published on the host: reachable here as 127.0.0.1:PORT, which dockerd trusts without TLS
if [ -n "$PVH_TEST_REGISTRY" ]; then
    socat TCP-LISTEN:"${PVH_TEST_REGISTRY##*:}",bind=127.0.0.1,fork,reuseaddr TCP:"$PVH_TEST_REGISTRY" &
fi
# pvisor-host's source, laid out as the installed package (the checkout is mounted read-only at /opt/repo)
rm -rf /opt/src && mkdir -p /opt/src/pvisor_host && cp -a /opt/repo/controller/. /opt/src/pvisor_host/
cp -a /opt/repo/adapters /opt/src/pvisor_host/adapters && cp -a /opt/repo/images /opt/src/pvisor_host/images
dockerd --log-level=warn >/var/log/dockerd.log 2>&1 &
i=0
until docker version >/dev/null 2>&1; do
    i=$((i+1)); [ $i -gt 600 ] && { cat /var/log/dockerd.log; exit 1; }; sleep 0.1
done
exec python -m pvisor_host node join "$@"
"""


def _dependencies() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], RAY]


def node_image_tag() -> str:
    """The node image's tag: a hash of the interpreter, the dependencies and this recipe."""
    material = json.dumps(
        {"python": sys.version, "prefix": sys.base_prefix, "deps": _dependencies(), "packages": NODE_PACKAGES,
         "start": NODE_START},
        sort_keys=True,
    )  # fmt: skip
    return f"pvisor-host-test/node:{hashlib.sha256(material.encode()).hexdigest()[:12]}"


#: Seconds a build of the node image may take (pip's download, then mmdebstrap): a hang fails it, not the suite.
BUILD_TIMEOUT = 1800
#: The build started ahead (:func:`start_node_image`), whose result (or error) every caller then gets.
_AHEAD: list[concurrent.futures.Future[str]] = []


def start_node_image(client) -> None:
    """Build the node image on a thread of its own from now (a test session does at its start, when a selected
    test needs the image: minutes on a new machine); :func:`build_node_image` then waits for that build. The
    thread is a daemon: a session that ends first does not wait for it."""
    if _AHEAD:
        return
    future: concurrent.futures.Future[str] = concurrent.futures.Future()
    environ = dict(os.environ)  # the environment as it is now, whole

    def build() -> None:
        try:
            future.set_result(_build_node_image(client, environ))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever needs the image
            future.set_exception(exc)

    _AHEAD.append(future)
    threading.Thread(target=build, name="node-image", daemon=True).start()


def build_node_image(client) -> str:
    """The node image (built when missing, or the build started ahead, whose error is raised here); its tag."""
    if _AHEAD:
        return _AHEAD[0].result()  # bounded by the build's own limits, and by pytest's timeout of a test's setup
    return _build_node_image(client, dict(os.environ))


def _build_node_image(client, environ: dict[str, str]) -> str:
    import docker.errors

    tag = node_image_tag()
    with contextlib.suppress(docker.errors.ImageNotFound):
        client.images.get(tag)
        return tag
    with tempfile.TemporaryDirectory(prefix="pvh-node-image-") as scratch:
        wheels = Path(scratch) / "wheels"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(wheels),
             *_dependencies()],
            check=True, env=environ, timeout=BUILD_TIMEOUT,
        )  # fmt: skip
        start = Path(scratch) / "node-start.sh"
        start.write_text(NODE_START)
        prefix = sys.base_prefix
        excludes = " ".join(
            f"--exclude='{prefix.lstrip('/')}/{p}'" for p in ("lib/python3.11/site-packages/*", "lib/python3.11/test")
        )
        hooks = [
            f'tar -C / {excludes} --exclude="*/__pycache__" -cf - {prefix.lstrip("/")} | tar -C "$1" -xf -',
            f'mkdir -p "$1/opt/wheels" && cp {wheels}/* "$1/opt/wheels/"',
            f'install -m 755 {start} "$1/node-start.sh"',
            f'chroot "$1" {prefix}/bin/python3 -m venv /opt/pvh',
            'chroot "$1" /opt/pvh/bin/pip install -q --no-index --find-links /opt/wheels '
            + " ".join(f"'{d}'" for d in _dependencies()),
            'rm -rf "$1/opt/wheels" "$1/root/.cache"',
        ]
        command = [
            "mmdebstrap", "--quiet", "--variant=minbase", f"--include={NODE_PACKAGES}",
            "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            *(f"--customize-hook={hook}" for hook in hooks),
            "bookworm", "-",
        ]  # fmt: skip
        environment = {k: v for k, v in environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CERT")}
        process = subprocess.Popen(command, stdout=subprocess.PIPE, env=environment, start_new_session=True)
        # mmdebstrap's work is done by a child of its own: a hang is ended in the whole group, with SIGTERM (its
        # worker then ends, and mmdebstrap cleans its chroot up); the import, and the wait below, end with it
        hung = threading.Timer(BUILD_TIMEOUT, os.killpg, (process.pid, signal.SIGTERM))
        hung.daemon = True
        hung.start()
        try:
            with process:  # its exit closes the pipe and waits for mmdebstrap
                repository, _, version = tag.partition(":")
                client.api.import_image_from_stream(
                    process.stdout,
                    repository=repository,
                    tag=version,
                    changes=[
                        "ENV LANG=C.UTF-8 PYTHONPATH=/opt/src PATH=/opt/pvh/bin:/usr/local/sbin:/usr/local/bin:"
                        "/usr/sbin:/usr/bin:/sbin:/bin RAY_USAGE_STATS_ENABLED=0",
                        f'LABEL {NODE_LABEL}="image"',
                        'ENTRYPOINT ["/node-start.sh"]',
                    ],
                )
        finally:
            hung.cancel()  # after the wait for mmdebstrap (Popen's exit), which it bounds too; never a stale group
        if process.returncode != 0:  # killed, or failed: what the engine made of its output is no node image
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(tag, force=True)
            raise AssertionError(f"mmdebstrap exited {process.returncode}")
    return tag


def docker0_address(client) -> str:
    """The host's address on the default bridge: where node containers reach the head."""
    from pvisor_host.backend.docker.gateway import network_gateway

    return network_gateway(client.networks.get("bridge").attrs)


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class Cluster:
    """A head on this host and nodes in containers; ``with Cluster(...) as cluster:`` removes all of it."""

    def __init__(self, client, *, nodes: int = 2, slots: int = 2, registry: str = "") -> None:
        self.client = client
        self.image = build_node_image(client)
        self.host = docker0_address(client)
        self.port = _free_port(self.host)
        self.address = f"{self.host}:{self.port}"
        self.token = secrets.token_hex(32)
        self.scratch = Path(tempfile.mkdtemp(prefix="pvh-cluster-"))
        self.token_file = self.scratch / "token"
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o644)  # read by the node's root inside its container
        self.temp_dir = self.scratch / "ray"
        self.nodes: list[str] = []
        self.closed = False
        """Whether it was stopped (a test that gets it afterwards fails at once: :meth:`heal`)."""
        self._count, self._slots = nodes, slots
        self._registry = registry
        """``HOST:PORT`` of a registry on the host that nodes reach as ``127.0.0.1:PORT``."""

    @property
    def env(self) -> dict[str, str]:
        """What a driver needs in its environment."""
        return {"RAY_AUTH_TOKEN": self.token}

    def __enter__(self) -> Cluster:
        try:
            self.start_head()
            for n in range(self._count):
                self.add_node(f"pvh-test-node{n + 1}-{secrets.token_hex(3)}")
            self.wait_for_nodes(self._count)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True
        for name in list(self.nodes):
            self.remove_node(name)
        self.stop_head()
        shutil.rmtree(self.scratch, ignore_errors=True)

    # -- head -------------------------------------------------------------------------------------------------

    def start_head(self) -> None:
        ray = Path(sys.executable).parent / "ray"
        environment = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                       "RAY_USAGE_STATS_ENABLED": "0", "RAY_health_check_period_ms": "1000",
                       "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}  # fmt: skip
        subprocess.run(
            [str(ray), "start", "--head", "--node-ip-address", self.host, "--port", str(self.port), "--num-cpus", "1",
             "--include-dashboard", "false", "--include-log-monitor", "false", "--temp-dir", str(self.temp_dir),
             "--disable-usage-stats"],
            check=True, env=environment, capture_output=True, timeout=120,
        )  # fmt: skip

    def head_pids(self) -> list[int]:
        """This head's processes: on this host (not in a container), their command line naming its temp dir
        or port, or their logs in its temp dir."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                cgroup = (entry / "cgroup").read_text()
            except OSError:
                continue
            if "docker" in cgroup or int(entry.name) == os.getpid():
                continue
            if (
                str(self.temp_dir) in cmdline
                or f"{self.host}:{self.port}" in cmdline
                or f"--port={self.port}" in cmdline
                or self._logs_here(entry)  # Ray's agents rename themselves (``ray::DashboardAgent``)
            ):
                found.append(int(entry.name))
        return found

    def _logs_here(self, process: Path) -> bool:
        """Whether the process writes into this head's temp dir (every Ray process logs there)."""
        try:
            return any(os.readlink(fd).startswith(str(self.temp_dir)) for fd in (process / "fd").iterdir())
        except OSError:
            return False

    def stop_head(self) -> None:
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            pids = self.head_pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while pids and time.monotonic() < deadline:
                pids = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
                time.sleep(0.1)
            if not pids:
                return

    # -- nodes ------------------------------------------------------------------------------------------------

    def add_node(self, name: str) -> str:
        """Start a node; its engine's state lives in the volume ``<name>-engine``, which a restart of the node's
        container keeps and :meth:`remove_node` removes."""
        api = self.client.api
        host_config = api.create_host_config(
            init=True,
            cap_add=["ALL"],
            cap_drop=["SYS_RESOURCE"],
            security_opt=["seccomp=unconfined", "apparmor=unconfined"],
            shm_size="512m",
            binds={
                f"{name}-engine": {"bind": "/var/lib/docker", "mode": "rw"},
                str(ROOT): {"bind": "/opt/repo", "mode": "ro"},
                str(self.token_file): {"bind": "/run/cluster-token", "mode": "ro"},
            },
        )
        host_config.update(MaskedPaths=[], ReadonlyPaths=[])  # the CLI's `--security-opt systempaths=unconfined`
        created = api.create_container(
            self.image,
            ["--address", self.address, "--slots", str(self._slots)],
            name=name,
            hostname=name,
            labels={NODE_LABEL: "node"},
            environment={"PVISOR_HOST_CLUSTER_TOKEN_FILE": "/run/cluster-token", "PVH_TEST_REGISTRY": self._registry},
            host_config=host_config,
        )
        if name not in self.nodes:
            self.nodes.append(name)
        api.start(created["Id"])
        return name

    def remove_node(self, name: str) -> None:
        import docker.errors

        with contextlib.suppress(docker.errors.NotFound):
            self.client.containers.get(name).remove(force=True, v=True)
        with contextlib.suppress(docker.errors.NotFound):
            self.client.volumes.get(f"{name}-engine").remove(force=True)
        if name in self.nodes:
            self.nodes.remove(name)

    def alive_engine_nodes(self) -> int:
        """Worker nodes the head has alive with a Docker engine."""
        done = subprocess.run(
            [sys.executable, "-c", _COUNT_NODES, self.address],
            env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        return int(done.stdout.strip() or -1)

    def heal(self) -> None:
        """Every node back and joined, as a test that took one down and failed before it brought it back may have
        left it: unpaused, on its network, running (a node the head marked dead exits by itself once it can reach
        the head again, and is started again here). Nodes that still have not joined after a minute are restarted
        (every node: which of them the head lost is not told here)."""
        import docker.errors

        if self.closed:
            raise AssertionError("the session's cluster was stopped before this test (cluster tests run together)")
        deadline = time.monotonic() + 60
        while True:
            for name in list(self.nodes):
                try:
                    node = self.client.containers.get(name)
                except docker.errors.NotFound:
                    self.add_node(name)  # its engine's volume is still there; it stays listed whatever happens
                    continue
                if node.status == "paused":
                    node.unpause()
                if "bridge" not in (node.attrs["NetworkSettings"]["Networks"] or {}):
                    self.client.networks.get("bridge").connect(node)
                node.reload()
                if node.status not in ("running", "restarting"):
                    node.start()
            if self.alive_engine_nodes() >= len(self.nodes):
                return
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        for name in self.nodes:
            with contextlib.suppress(docker.errors.APIError):
                self.client.containers.get(name).restart(timeout=0)
        self.wait_for_nodes(len(self.nodes))

    def wait_for_nodes(self, count: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.alive_engine_nodes() >= count:
                return
            time.sleep(1)
        logs = {name: self.node_logs(name)[-2000:] for name in self.nodes}
        raise AssertionError(f"{count} nodes did not join within {timeout}s: {logs}")

    def node_logs(self, name: str) -> str:
        return self.client.containers.get(name).logs().decode(errors="replace")

    def node_containers(self, name: str, *, all_states: bool = True) -> list[str]:
        """The containers in a node's own engine that carry pvisor-host labels."""
        done = self.client.containers.get(name).exec_run(
            ["docker", "ps", "-q" + ("a" if all_states else ""), "--filter", "label=pvisor-host.managed"]
        )
        return done.output.decode().split()


_COUNT_NODES = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("docker_engine", 0) >= 1))
"""


class Registry:
    """A real registry (Debian's ``docker-registry``, in a container of the node image) published on this host
    at ``127.0.0.1:PORT``, which the host engine trusts without TLS, and on the ``docker0`` address for the
    nodes (whose forwarder makes it ``127.0.0.1:PORT`` there too)."""

    #: Debian's default configuration asks for htpasswd authentication: this one does not.
    CONFIG = (
        "version: 0.1\nlog: {level: warn}\nstorage: {filesystem: {rootdirectory: /var/lib/registry}}\n"
        "http: {addr: ':5000'}\n"
    )

    def __init__(self, client, *, mirror_of: str | None = None) -> None:
        """``mirror_of``: a pull-through cache of that registry (``host:port``, as a container reaches it)."""
        self.client = client
        self.port = _free_port("127.0.0.1")
        self.host = docker0_address(client)
        self.container = None
        self.config = self.CONFIG + (f"proxy: {{remoteurl: 'http://{mirror_of}'}}\n" if mirror_of else "")

    @property
    def name(self) -> str:
        """What the driver is told (``--registry``): the one name that works on the host and on the nodes."""
        return f"127.0.0.1:{self.port}"

    @property
    def for_nodes(self) -> str:
        return f"{self.host}:{self.port}"

    def __enter__(self) -> Registry:
        image = build_node_image(self.client)
        self.container = self.client.containers.run(
            image,
            ["-c", 'printf "%s" "$CONFIG" > /tmp/registry.yml && exec docker-registry serve /tmp/registry.yml'],
            entrypoint=["/bin/sh"],
            environment={"CONFIG": self.config},
            detach=True,
            labels={NODE_LABEL: "registry"},
            ports={"5000/tcp": [("127.0.0.1", self.port), (self.host, self.port)]},
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return self
            time.sleep(0.2)
        raise AssertionError(f"the registry did not listen: {self.container.logs().decode(errors='replace')}")

    def __exit__(self, *exc: object) -> None:
        if self.container is not None:
            self.container.remove(force=True, v=True)

    def digests(self, repository: str) -> list[str]:
        """The digests the registry holds for ``repository`` (every tag)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/{repository}/tags/list", timeout=10) as answer:
            tags = json.load(answer).get("tags") or []
        found = []
        for tag in tags:
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.port}/v2/{repository}/manifests/{tag}",
                method="HEAD",
                headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
            )
            with urllib.request.urlopen(request, timeout=10) as answer:
                found.append(answer.headers["Docker-Content-Digest"])
        return found


# -- what the cluster tests share -------------------------------------------------------------------------

#: The model key the cluster tests hand their batches (never to be found on a node or in a run).
KEY = "sk-test-cluster-key-5e1f0b"


def one(command: str, result: str = "", n: int = 0, version: str | None = None) -> list[dict]:
    extra = {"version": version} if version else {}
    calls = [Turn([Call("Bash", {"command": command, "timeout": 120000}, result)])]
    return claude_session(f"Task {n}.", calls, **extra)


def slow_manifest(root: Path, count: int, seconds: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for n in range(count):
        write_jsonl(root / f"s{n}.jsonl", one(f"sleep {seconds}; echo {n}", f"{n}\n", n))
        lines.append({"id": f"s{n}", "trajectory": f"s{n}.jsonl", "after_step": 1})
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest


def batch(manifest: Path, out: Path, *args: str, env: dict[str, str] | None = None):
    return run_cli(
        "batch", manifest, "--agent", "claude-code", "--mode", "replay-only", "--out", out, "--quiet", *args,
        env={"PVH_TEST_MODEL_KEY": KEY, **(env or {})},
    )  # fmt: skip


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def records(out: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/record.json")}


def explain(out: Path, stderr: str) -> str:
    """What a failed batch left to say why: its stderr, the summary's counts, and every item not ok (its status,
    failure, node and other starts), for an assertion's message."""
    lines = [stderr.rstrip()]
    if (out / "summary.json").exists():
        lines.append(f"counts: {summary(out)['counts']}")
    for name, record in sorted(records(out).items()):
        if record.get("status") != "ok":
            where = (record.get("host") or {}).get("node")
            lines.append(
                f"{name}: {record.get('status')} on {where}: {record.get('failure')} {record.get('superseded')}"
            )
    return "\n".join(lines)

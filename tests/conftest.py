"""Shared fixtures: the real engine, the real sandbox images, and a CLI runner in a real subprocess.

A test that needs the engine asks for it through a fixture (``docker_client``, or one built on it:
``backend``, ``claude_image``, ...), and is marked ``docker`` for that (:func:`pytest_collection_modifyitems`):
no test can forget the mark. Every other test runs with ``DOCKER_HOST`` pointing nowhere, so one that reaches
the engine some other way fails instead of passing by luck. Without an engine the ``docker`` tests are skipped
locally; when ``CI=true`` they fail instead: CI must never pass by skipping them.

Children that a test may interrupt start with SIGINT, SIGHUP and SIGTERM at their defaults
(:func:`default_signals`): a test suite started in the background of a script (``nohup make test &``) runs
with SIGINT ignored, and children would inherit that.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(Path(__file__).resolve().parent))

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: The fixtures that reach the engine; a test using any of them (directly or through another) needs it.
ENGINE_FIXTURES = frozenset({"docker_client"})
#: Where tests that do not need the engine find one: nowhere.
NO_ENGINE = "unix:///nonexistent/pvisor-host-no-engine-for-this-test.sock"


#: Agent images whose build takes minutes (pip installs of their SDKs): built in the background from the
#: session's start, in this order, while the other tests run (:func:`agent_image`).
SLOW_BUILDS = ("mini-swe-agent", "pi-agent", "openhands")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``docker`` every test that uses an engine fixture, directly or through another fixture; run the tests
    of the agents built in the background (:func:`slow_builds`) last, so that their builds overlap the rest of the
    suite rather than hold up its start; and just before them the tests on the session's Ray cluster
    (:func:`ray_cluster`), one after another, so that the cluster is up only while they run."""
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.docker)
    items.sort(key=lambda item: (_built_in_the_background(item), _on_the_cluster(item)))  # stable otherwise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Once the last test on the session's Ray cluster has torn down (or failed to), the cluster and its registry
    go (they are not torn down again at the session's end)."""
    try:
        return (yield)
    finally:
        if _LAST_ON_THE_CLUSTER and item is _LAST_ON_THE_CLUSTER[0]:
            while _CLUSTER_STOPS:
                _CLUSTER_STOPS.pop()()


#: Every test phase's duration, written when the session ends (``test-durations.tsv`` at the repository's root,
#: slowest first, appended to by each session of a run: ``make test`` then ``make test-faults``), so that the next
#: change to the suite is measured against this one. ``--durations=30`` prints the slowest on the terminal.
DURATIONS = ROOT / "test-durations.tsv"
_durations: list[tuple[float, str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations.append((report.duration, report.when, report.nodeid))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _durations and not hasattr(session.config, "workerinput"):
        with DURATIONS.open("a", encoding="utf-8") as out:
            for seconds, when, nodeid in sorted(_durations, reverse=True):
                out.write(f"{seconds:.2f}\t{when}\t{nodeid}\n")


#: How to stop the session's cluster and its registry, last started first (see :func:`pytest_runtest_teardown`).
_CLUSTER_STOPS: list[Callable[[], None]] = []
_LAST_ON_THE_CLUSTER: list[pytest.Item] = []


def _on_the_cluster(item: pytest.Item) -> bool:
    return bool({"ray_cluster", "cluster_registry"} & set(getattr(item, "fixturenames", ())))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note the last test on the session's cluster, in the order the session runs them (``--ff`` and the like
    reorder after the sort above)."""
    _LAST_ON_THE_CLUSTER[:] = [item for item in session.items if _on_the_cluster(item)][-1:]


def _built_in_the_background(item: pytest.Item) -> bool:
    """Whether the test runs an agent of :data:`SLOW_BUILDS` (its ``agent`` parameter)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "agent_image" in getattr(item, "fixturenames", ()) and params.get("agent") in SLOW_BUILDS


@pytest.fixture(autouse=True)
def no_engine_unless_asked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test without the ``docker`` mark sees no engine (its children neither)."""
    if request.node.get_closest_marker("docker") is None:
        monkeypatch.setenv("DOCKER_HOST", NO_ENGINE)


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` in this process for the test, even when the suite was
    started with SIGINT ignored (then Python does not install its handler)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def default_signals() -> None:
    """``preexec_fn`` for a child a test may interrupt: SIGINT, SIGHUP and SIGTERM at their defaults, whatever
    this process inherited (a script's background job has SIGINT ignored, ``nohup`` SIGHUP)."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@dataclass
class CliResult:
    """A finished ``pvisor-host`` process."""

    code: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def run_cli(
    *args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 600
) -> CliResult:
    """Run ``pvisor-host`` (``python -m pvisor_host``) as a real process.

    One that runs past ``timeout`` is interrupted as a user would (Ctrl-C, so that it removes its sandboxes),
    killed only if that does not end it, and the test fails with what it printed.
    """
    environment = {**os.environ, **(env or {})}
    environment.pop("PVISOR_HOST_DEBUG", None)
    with subprocess.Popen(
        [sys.executable, "-m", "pvisor_host", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        cwd=cwd,
        preexec_fn=default_signals,  # it is interrupted when it runs too long
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
            try:
                stdout, stderr = process.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate()
            command = " ".join(map(str, args))
            pytest.fail(f"pvisor-host {command} ran past {timeout:.0f}s and was interrupted: {stderr[-3000:]}")
    return CliResult(process.returncode, stdout, stderr)


def invoke_cli(*args: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> CliResult:
    """Run the CLI's own ``main`` in this process, as :func:`run_cli` runs it in a child (for the refusals the
    host decides, which need no engine and no Ctrl-C: a child costs half a second each). Warnings are shown as
    in a real process, not raised; an exit 130 is returned, not made with ``os._exit``. Afterwards the
    environment, working directory, signal handlers and the interrupt counter are this process's again, and
    loguru has its default sink and pvisor-host's records disabled, as the library leaves them."""
    import importlib
    import io

    from loguru import logger

    from pvisor_host import signals as pvh_signals

    cli_main = importlib.import_module("pvisor_host.cli.main")  # the module (the package exports its function)
    cli_shared = importlib.import_module("pvisor_host.cli.shared")
    cli_shared.console.cache_clear()  # one for the captured stream

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)}
    environment, directory = dict(os.environ), os.getcwd()
    insisting, exit_interrupted = pvh_signals._INSISTING, cli_main.exit_interrupted
    enabled = insisting.enabled
    stdout, stderr = io.StringIO(), io.StringIO()
    os.environ.update(env or {})
    os.environ.pop("PVISOR_HOST_DEBUG", None)
    code: int | str | None = 0
    cli_main.exit_interrupted = lambda: sys.exit(130)  # type: ignore[assignment]
    try:
        if cwd is not None:
            os.chdir(cwd)
        with (
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
            warnings.catch_warnings(),
        ):
            _python_warning_filters()
            try:
                cli_main.main([str(arg) for arg in args])
            except SystemExit as exc:
                code = exc.code
    finally:
        cli_main.exit_interrupted = exit_interrupted
        os.chdir(directory)
        os.environ.clear()
        os.environ.update(environment)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        insisting.settle()
        insisting.enabled, insisting.interrupts = enabled, 0
        logger.remove()  # the CLI's sink writes to the captured stream
        logger.add(sys.stderr)
        logger.disable("pvisor_host")
        cli_shared.console.cache_clear()  # made for the captured stream
    assert isinstance(code, int), code
    return CliResult(code, stdout.getvalue(), stderr.getvalue())


def _python_warning_filters() -> None:
    """The warning filters a plain ``python`` process starts with (pytest's own differ): what a user sees."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


def start_cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``pvisor-host`` as a real process in the background (for signals and live inspection)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pvisor_host", *map(str, args)],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )


def wait_for_running(client, run_id: str, process: subprocess.Popen[str], timeout: float = 90, *,
                     command: str | None = None):  # fmt: skip
    """The running replay container of ``run_id``, once a process in it runs ``command`` when given (fails if the
    CLI exits or nothing appears in time)."""
    import docker.errors

    deadline = time.monotonic() + timeout
    while True:
        running = client.containers.list(filters={"label": f"pvisor-host.run={run_id}"}, ignore_removed=True)
        try:
            if running and (command is None or any(row[-1] == command for row in running[0].top()["Processes"])):
                return running[0]
        except docker.errors.APIError as exc:  # a container that ended between the two calls
            if exc.status_code not in (404, 409):
                raise
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)  # the CLI removes its sandbox
            try:
                _, stderr = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                _, stderr = process.communicate()
            pytest.fail(f"no container of run {run_id} ran {command or 'at all'}: exit {process.returncode}: {stderr}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def docker_client():
    """A client for the real engine (skip locally, fail in CI, when there is none)."""
    import docker

    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as exc:  # noqa: BLE001
        message = f"no Docker engine: {exc}"
        if IN_CI:
            pytest.fail(f"CI=true and {message}; `make test` starts one")
        pytest.skip(message)
    return client


@pytest.fixture(scope="session")
def backend(docker_client):
    """The Docker backend, as the CLI opens it, on the session's engine."""
    from pvisor_host.backend.docker import DockerBackend
    from pvisor_host.models.ownership import Ownership

    return DockerBackend(docker_client, Ownership.current())


def build_image(backend, agent: str) -> str:
    """Build (or find) the verified image of ``agent`` through the backend seam; its tag."""
    from pvisor_host.models.image import BuildOptions, BuildPlan
    from pvisor_host.models.profiles import get_profile

    built = backend.ensure_image(BuildPlan(profile=get_profile(agent)), BuildOptions()).built
    assert built is not None
    return built.tag


#: A tag of the user's own on our claude-code image, as a user who pushes it to a registry of theirs gives it: the
#: suite runs on an engine where our images carry others' tags too (they are still named by ours).
USER_TAG = "pvh-user/claude:mine"


@pytest.fixture(scope="session")
def claude_image(backend, docker_client) -> Iterator[str]:
    """The verified Claude Code 2.1.220 sandbox image (built once per machine), tagged by a user too."""
    tag = build_image(backend, "claude-code")
    repository, _, name = USER_TAG.partition(":")
    docker_client.images.get(tag).tag(repository, name)
    yield tag
    with contextlib.suppress(Exception):
        docker_client.images.remove(USER_TAG)


@pytest.fixture(scope="session")
def codex_image(backend) -> str:
    """The verified Codex 0.149.0 sandbox image."""
    return build_image(backend, "codex")


@pytest.fixture(scope="session")
def base_image(docker_client, claude_image) -> str:
    """The base the agent images were built on (no pvisor, no agent)."""
    return docker_client.images.get(claude_image).labels["pvisor-host.base-image"]


def _labelled(client, kind: str) -> list[str]:
    filters = {"label": "pvisor-host.managed"}
    if kind == "containers":  # sparse: no inspect per container, which another process may remove meanwhile
        listed = client.containers.list(all=True, filters=filters, sparse=True)
        return [name.lstrip("/") for c in listed for name in c.attrs.get("Names", [])[:1]]
    if kind == "volumes":
        return [v.name for v in client.volumes.list(filters=filters)]
    return [n.name for n in client.networks.list(filters=filters)]


def _engine_or_none():
    try:
        import docker

        client = docker.from_env()
        client.ping()
    except Exception:  # noqa: BLE001
        return None
    return client


def labelled_resources(client) -> dict[str, set[str]]:
    """Names of every container, volume and network carrying pvisor-host labels."""
    return {kind: set(_labelled(client, kind)) for kind in ("containers", "volumes", "networks")}


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(request) -> Iterator[None]:
    """After the whole suite: no container, volume or network with our labels that the suite created remains.
    Before it, the orphans of a killed earlier run are collected (tests that assert "none of ours running"
    would otherwise see them)."""
    if not any(item.get_closest_marker("docker") for item in request.session.items):
        yield
        return
    client = _engine_or_none()
    if client is not None:  # what a killed earlier run left (kill -9, a machine restart) goes first, as `gc` does
        from pvisor_host.backend.docker.cleanup.gc import collect_garbage
        from pvisor_host.models.ownership import Ownership

        try:
            collect_garbage(client, Ownership.current())
        except Exception as exc:  # noqa: BLE001 - the suite still runs; a leftover then fails the test it disturbs
            warnings.warn(f"could not collect an earlier run's orphans: {exc}", stacklevel=1)
    before = labelled_resources(client) if client is not None else {}
    yield
    if client is None:
        return
    deadline = time.monotonic() + 10
    while True:
        left = {kind: sorted(names - before.get(kind, set())) for kind, names in labelled_resources(client).items()}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not any(left.values()), f"pvisor-host resources left behind: {left}"


@pytest.fixture
def containers_created(docker_client, slow_builds):
    """Call with a start time: the labels of every container the engine created since then. While
    :func:`slow_builds` builds in the background (a new engine), the containers it makes are left out: its build
    steps' (the image's labels, no ``pvisor-host.session``) and its probes' (owned by this test process, not by
    the command under test)."""
    from pvisor_host.models.ownership import Ownership

    building = not all(future.done() for future in slow_builds.values())
    suite = Ownership.current().owner

    def created(since: float) -> list[dict[str, str]]:
        events = docker_client.events(
            since=f"{since:.6f}",
            until=f"{time.time() + 1:.6f}",
            decode=True,
            filters={"type": "container", "event": "create"},
        )
        labels = [event.get("Actor", {}).get("Attributes", {}) for event in events]
        if building or not all(future.done() for future in slow_builds.values()):
            labels = [
                x for x in labels
                if not (x.get("pvisor-host.role") and "pvisor-host.session" not in x)
                and x.get("pvisor-host.owner") != suite
            ]  # fmt: skip
        return labels

    return created


def build_test_image(client, tag: str, dockerfile: str, **kwargs) -> str:
    """Build a small labelled test image from a Dockerfile text (classic builder, as docker-py uses)."""
    import io

    client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True, forcerm=True, **kwargs)
    return tag


@pytest.fixture(scope="session")
def agent_image(backend, slow_builds):
    """Build (or find) the verified image of any agent, once per session: ``agent_image("pi-agent")`` (the
    slow ones come from :func:`slow_builds`, started at the session's start)."""
    built: dict[str, str] = {}

    def image(agent: str) -> str:
        if agent not in built:
            built[agent] = slow_builds[agent].result() if agent in slow_builds else build_image(backend, agent)
        return built[agent]

    return image


@pytest.fixture(scope="session", autouse=True)
def node_image_ahead(request: pytest.FixtureRequest) -> None:
    """The cluster node image (``tests/cluster.py``: the cluster's nodes and the tests' registries run in it),
    built on a thread of its own from the session's start when a selected test needs it (:func:`node_image`):
    minutes on a new machine, which the first test to need it, half-way through the suite, would otherwise wait
    for; nothing when it is there."""
    if not any("node_image" in getattr(item, "fixturenames", ()) for item in request.session.items):
        return
    try:
        request.getfixturevalue("nothing_left_behind")  # its sweep and its count come first
        client = request.getfixturevalue("docker_client")
        request.getfixturevalue("claude_image")  # after the base every test needs, not in its way
    except (Exception, pytest.skip.Exception, pytest.fail.Exception):  # noqa: BLE001 - the tests that need these say why
        return
    from cluster import start_node_image

    start_node_image(client)


@pytest.fixture(scope="session")
def node_image(docker_client) -> str:
    """The cluster node image's tag, once it is built (see :func:`node_image_ahead`)."""
    from cluster import build_node_image

    return build_node_image(docker_client)


@pytest.fixture(scope="session", autouse=True)
def slow_builds(request) -> Iterator[dict[str, Any]]:
    """The :data:`SLOW_BUILDS` images, built one after another on a thread of their own from the session's start
    when a selected test needs ``agent_image`` (futures, by agent); none otherwise."""
    if not any("agent_image" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield {}
        return
    import concurrent.futures

    backend = request.getfixturevalue("backend")
    request.getfixturevalue("claude_image")  # the base the agents share is bootstrapped once, here, first
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="slow-build") as pool:
        yield {agent: pool.submit(build_image, backend, agent) for agent in SLOW_BUILDS}


@pytest.fixture(scope="module")
def runtime_volumes_removed_afterwards(docker_client):
    """Runtime volumes are a cache that outlives runs by design; a module that injects removes the ones it filled."""
    existing = {v.name for v in docker_client.volumes.list(filters={"label": "pvisor-host.role=runtime"})}
    yield
    for volume in docker_client.volumes.list(filters={"label": "pvisor-host.role=runtime"}):
        if volume.name not in existing:
            volume.remove(force=True)


@pytest.fixture(scope="session")
def cluster_registry(docker_client, node_image) -> Iterator[Any]:
    """The registry of the cluster tests (``tests/cluster.py``'s ``Registry``), for the session."""
    from cluster import Registry

    with _stopped_once(Registry(docker_client)) as registry:
        yield registry


@pytest.fixture(scope="session")
def ray_cluster(docker_client, claude_image, cluster_registry) -> Iterator[Any]:
    """One Ray cluster for every cluster test of the session (``tests/cluster.py``'s ``Cluster``): two nodes of two
    slots that reach :func:`cluster_registry`. A test that takes a node down brings it back before it ends: a lost
    node restarts that node, never the cluster. The cluster tests run last (:func:`pytest_collection_modifyitems`),
    so it is up only while they run."""
    from cluster import Cluster

    with _stopped_once(Cluster(docker_client, nodes=2, slots=2, registry=cluster_registry.for_nodes)) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def cluster_whole(request: pytest.FixtureRequest) -> None:
    """Before each test on the session's cluster, every node back and joined (``tests/cluster.py``'s
    ``Cluster.heal``): a test that fails after taking a node down cannot fail the ones after it."""
    if "ray_cluster" in request.fixturenames:
        request.getfixturevalue("ray_cluster").heal()


@contextlib.contextmanager
def _stopped_once(resource: Any) -> Iterator[Any]:
    """``resource`` entered, and exited once: after the last test that uses it (:data:`_CLUSTER_STOPS`), or at the
    end of the session if that did not come."""
    entered = resource.__enter__()
    done = False

    def stop() -> None:
        nonlocal done
        if not done:
            done = True
            resource.__exit__(None, None, None)

    _CLUSTER_STOPS.append(stop)
    try:
        yield entered
    finally:
        stop()
        with contextlib.suppress(ValueError):
            _CLUSTER_STOPS.remove(stop)


@pytest.fixture(scope="session")
def chromium() -> str:
    """The Chromium the report tests drive (``make test`` installs it)."""
    from browser import chromium_path

    path = chromium_path()
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed; `make test` installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path


@pytest.fixture
def caplog_lines():
    """The lines pvisor-host logs meanwhile (a callable: the lines so far)."""
    from pvisor_host._log import logger

    lines: list[str] = []
    logger.enable("pvisor_host")
    sink = logger.add(lambda message: lines.append(str(message)), level="INFO", format="{message}")
    yield lambda: lines
    logger.remove(sink)
    logger.disable("pvisor_host")

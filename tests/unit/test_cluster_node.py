"""What a cluster node does with an image and a finished copy, without Ray or an engine: the image arrives once
(by digest, or from the driver's chunks) and is checked by id; a run directory goes back as a tar in chunks
and is removed. The real cluster runs in ``tests/integration/test_cluster.py``."""

from __future__ import annotations

import io
import socket
import tarfile
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import docker.errors
import pytest
from fakecache import MB, Clock, FakeEngine

from pvisor_host.backend.cluster.node import tasks as node
from pvisor_host.backend.docker.image.images import ImageStore
from pvisor_host.errors import ImageUnavailable, InfrastructureError, RegistryError
from pvisor_host.files.archive import Budget, extract_tar, tar_stream

IMAGE_ID = "sha256:" + "cd" * 32
REF = "pvisor-host/codex:0.149.0-pvisor0.3.1-0123456789ab"


class FakeImages:
    """The engine's images: ``load`` and ``pull`` give ``gives`` (an id), slowly, and are counted."""

    def __init__(self, gives: str = IMAGE_ID) -> None:
        self.present: dict[str, list[str]] = {}
        self.gives = gives
        self.loaded: list[bytes] = []
        self.pulled: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def get(self, name: str) -> SimpleNamespace:
        if name not in self.present:
            raise docker.errors.ImageNotFound(name)

        def tag(repository: str, tag: str | None = None) -> None:
            if "@" in repository or not tag or "@" in tag:  # as the engine answers such a name
                raise docker.errors.APIError(f"invalid reference format: {repository}:{tag}")
            self.present[name].append(f"{repository}:{tag}")

        return SimpleNamespace(tag=tag, tags=self.present[name])

    def load(self, handle: io.BufferedReader) -> None:
        data = handle.read()
        threading.Event().wait(0.2)  # long enough for a second copy to arrive meanwhile
        with self.lock:
            self.loaded.append(data)
            self.present[self.gives] = [REF]

    def pull(self, repository: str, tag: str) -> None:
        with self.lock:
            self.pulled.append((repository, tag))
            self.present[self.gives] = []


@pytest.fixture
def images(monkeypatch, tmp_path) -> FakeImages:
    fake = FakeImages()
    monkeypatch.setenv(node.SCRATCH_ENV, str(tmp_path / "scratch"))
    store = ImageStore(SimpleNamespace(images=fake))  # the Docker backend's image API over a fake engine
    monkeypatch.setattr(node, "backend_for", lambda session: SimpleNamespace(images=store))
    return fake


def test_an_image_the_node_has_gets_nothing(images):
    images.present[IMAGE_ID] = [REF]
    assert node.ensure_image("s", {"id": IMAGE_ID, "ref": REF, "chunks": ["c0"]}, fetch_chunk=pytest.fail)
    assert images.loaded == images.pulled == []


def test_without_chunks_or_a_registry_the_node_asks_for_the_image(images):
    assert node.ensure_image("s", {"id": IMAGE_ID, "ref": REF}, fetch_chunk=pytest.fail) is False


def test_copies_arriving_at_once_load_the_chunks_once(images):
    chunks = {"c0": b"first ", "c1": b"second"}
    done: list[bool] = []
    image = {"id": IMAGE_ID, "ref": REF, "chunks": ["c0", "c1"]}
    copies = [threading.Thread(target=lambda: done.append(node.ensure_image("s", image, chunks.get))) for _ in "abc"]
    for copy in copies:
        copy.start()
    for copy in copies:
        copy.join()
    assert done == [True, True, True]
    assert images.loaded == [b"first second"]  # once, the chunks in order
    assert not [p for p in node.scratch_root().iterdir() if p.name.startswith("upload-")]  # the upload is gone


def test_a_pull_is_by_digest_and_the_node_tags_the_image_as_the_driver_knows_it(images):
    pull = f"127.0.0.1:5000/pvisor-host/codex@sha256:{'ef' * 32}"
    assert node.ensure_image("s", {"id": IMAGE_ID, "ref": REF, "pull": pull}, fetch_chunk=pytest.fail)
    assert images.pulled == [("127.0.0.1:5000/pvisor-host/codex", f"sha256:{'ef' * 32}")]
    assert images.present[IMAGE_ID] == [REF]


def test_an_image_known_by_its_digest_is_pulled_by_it_and_not_tagged(images):
    ref = f"127.0.0.1:5001/task/t1@sha256:{'ab' * 32}"
    pull = f"127.0.0.1:5000/task/t1@sha256:{'ef' * 32}"
    assert node.ensure_image("s", {"id": IMAGE_ID, "ref": ref, "pull": pull}, fetch_chunk=pytest.fail)
    assert images.pulled == [("127.0.0.1:5000/task/t1", f"sha256:{'ef' * 32}")]
    assert images.present[IMAGE_ID] == []  # a digest is not a name one can give an image


def test_a_pull_that_fails_is_one_line_naming_the_node(images):
    def refuse(repository: str, tag: str) -> None:
        raise docker.errors.APIError("manifest unknown")

    images.pull = refuse  # type: ignore[method-assign]
    pull = f"127.0.0.1:5000/pvisor-host/codex@sha256:{'ef' * 32}"
    with pytest.raises(InfrastructureError) as caught:
        node.ensure_image("s", {"id": IMAGE_ID, "ref": REF, "pull": pull}, fetch_chunk=pytest.fail)
    assert caught.value.one_line() == (f"{node.node_name()}: Docker engine failed to pull {pull}: manifest unknown")


def test_an_image_that_arrives_as_another_id_is_refused(images):
    images.gives = "sha256:" + "00" * 32
    with pytest.raises(InfrastructureError) as caught:
        node.ensure_image("s", {"id": IMAGE_ID, "ref": REF, "chunks": ["c0"]}, fetch_chunk=lambda ref: b"x")
    assert caught.value.one_line() == f"{node.node_name()}: {REF} arrived as another image than {IMAGE_ID[:19]}"


def test_a_run_directory_goes_back_in_chunks_and_is_removed(monkeypatch, tmp_path):
    monkeypatch.setenv(node.SCRATCH_ENV, str(tmp_path / "scratch"))
    monkeypatch.setattr(node, "CHUNK", 4096)
    run = node.scratch_root() / "session" / "token" / "run"
    (run / "workspace").mkdir(parents=True)
    (run / "record.json").write_text('{"status": "ok"}')
    (run / "workspace" / "big.bin").write_bytes(bytes(range(256)) * 100)
    chunks = list(node.fetch_run("session", "token"))
    assert len(chunks) > 1 and all(len(c) <= 4096 for c in chunks)
    assert not (node.scratch_root() / "session").exists()  # the copy's folder, then the batch's empty folder
    report = extract_tar(tar_stream(iter(chunks)), tmp_path / "back", Budget(2**20))
    assert not report.skipped
    assert (tmp_path / "back" / "record.json").read_text() == '{"status": "ok"}'
    assert (tmp_path / "back" / "workspace" / "big.bin").read_bytes() == bytes(range(256)) * 100


def test_a_copy_with_no_run_directory_sends_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv(node.SCRATCH_ENV, str(tmp_path / "scratch"))
    (node.scratch_root() / "session" / "token" / "input").mkdir(parents=True)
    assert list(node.fetch_run("session", "token")) == []
    assert not (node.scratch_root() / "session" / "token").exists()


def _tar_names(chunks: list[bytes]) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as archive:
        return archive.getnames()


def test_the_tar_has_one_top_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(node.SCRATCH_ENV, str(tmp_path / "scratch"))
    run = node.scratch_root() / "s" / "t" / "run"
    run.mkdir(parents=True)
    (run / "a.txt").write_text("a")
    assert sorted(_tar_names(list(node.fetch_run("s", "t")))) == ["run", "run/a.txt"]


def test_scratch_defaults_to_the_temp_dir(monkeypatch):
    monkeypatch.delenv(node.SCRATCH_ENV, raising=False)
    assert node.scratch_root() == Path(tempfile.gettempdir()) / "pvisor-host-node"


class TaskBackend:
    """A node's Docker backend as :mod:`~pvisor_host.backend.cluster.node.images` uses it: the real image cache
    over a fake engine (:mod:`fakecache`), images named ``r/tN`` pulled by digest; injections recorded."""

    def __init__(self, tmp_path: Path, session: str = "s1", budget: int | None = None) -> None:
        from pvisor_host.backend.docker.image.cache import ImageCache, Ledger
        from pvisor_host.models.ownership import Ownership

        self.engine = FakeEngine()
        self.clock = Clock()
        ownership = Ownership.current(session=session)
        ledger = Ledger(tmp_path / "state" / "cache.json", ownership)
        self.image_cache = ImageCache(self.engine, ledger, ownership, clock=self.clock, sleep=self.clock.sleep)
        self.budget = budget
        self.injected = 0
        self.released: list[str] = []

    def add(self, n: int, own: int = 20 * MB) -> dict:
        """Task image ``n`` on the environment everyone shares, in the registry; its task as the driver sends it."""
        image = self.engine.add(f"r/t{n}", [("os", 50 * MB), ("env", 250 * MB)], [(f"own{n}", own)])
        pull = f"r/t{n}@{image.id}"
        self.engine.registry[pull] = image
        return {"id": image.id, "ref": f"r/t{n}:v1", "pull": pull, "budget": self.budget}

    def reserve_image(self, ref, *, budget, cancel=None, owned=True, done=None):
        return self.image_cache.reserve(ref, budget=budget, cancel=cancel, owned=owned, done=done)

    def fill_image(self, hold, *, progress=None, cancel=None):
        return self.image_cache.fill(hold, progress=progress, cancel=cancel)

    def release_image(self, hold) -> None:
        self.released.append(hold.ref)
        self.image_cache.release(hold)

    def image_budget(self) -> int | None:
        return None

    def inject_into(self, prepared, agent_image_id: str) -> None:
        self.injected += 1


PREPARED = SimpleNamespace(image=SimpleNamespace(runtime_volume="rt"))


class Ledger:
    """The batch's ledger as a node asks it: which task images are done (and how often it was asked)."""

    def __init__(self) -> None:
        self.done: set[str] = set()
        self.asked = 0


@pytest.fixture
def task_images(monkeypatch):
    """The node's task-image module, its driver's "done" answer the ledger the test gives."""
    from pvisor_host.backend.cluster.node import images

    def done(ledger: Ledger) -> list[str]:
        ledger.asked += 1
        return sorted(ledger.done)

    monkeypatch.setattr(images, "_done", done)
    return images


def test_copies_hold_their_image_until_released_and_the_node_keeps_it_for_the_next_batch(task_images, tmp_path):
    backend = TaskBackend(tmp_path)
    ledger = Ledger()
    task = backend.add(1)
    hold, pulled = task_images.prepare_task(backend, tmp_path, PREPARED, task, "agent", ledger)
    assert pulled == task["id"] and backend.injected == 1
    again, pulled_again = task_images.prepare_task(backend, tmp_path, PREPARED, task, "agent", ledger)
    assert pulled_again is None  # present: no second pull
    (entry,) = backend.image_cache.entries()
    assert set(entry.holds) == {hold.token, again.token} and entry.owner is None  # the cache's, not a batch's
    backend.release_image(hold)
    backend.release_image(again)
    assert backend.image_cache.finish() == []  # no batch removes it: it stays for the next one, within the budget
    assert ledger.asked == 0  # no room was short: the driver was not asked
    usage = task_images.status(backend)
    assert usage == {"images": 1, "bytes": 320 * MB, "peak": 320 * MB, "budget": None}


def test_room_takes_only_images_the_driver_says_are_done_and_asks_it_only_when_room_is_short(task_images, tmp_path):
    backend = TaskBackend(tmp_path, budget=340 * MB)
    ledger = Ledger()
    first = backend.add(1)
    hold, _ = task_images.prepare_task(backend, tmp_path, PREPARED, first, "agent", ledger)
    backend.release_image(hold)  # its copy ended; the batch still has items of it
    ledger.asked = 0  # (the first pull's estimate, 3 × compressed, was over the budget: nothing could go)
    backend.clock.on_wait = lambda: ledger.done.add(first["id"]) if backend.clock.waits == 2 else None
    second = backend.add(2, own=30 * MB)  # 50 + 250 + 20 + 30 > 340: image 1 must go, once it is done
    task_images.prepare_task(backend, tmp_path, PREPARED, second, "agent", ledger)
    assert backend.engine.removals == ["r/t1@" + first["id"]]
    assert ledger.asked == 3 and backend.clock.waits == 2


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), RuntimeError("engine gone")])
def test_a_pull_that_fails_in_any_way_leaves_no_hold_and_no_note(task_images, tmp_path, failure):
    backend = TaskBackend(tmp_path)
    task = backend.add(1)
    backend.engine.fail_pull[task["pull"]] = failure
    with pytest.raises(type(failure)):
        task_images.prepare_task(backend, tmp_path, PREPARED, task, "agent", Ledger())
    assert backend.image_cache.entries() == [] and backend.released == [task["pull"]]


@pytest.mark.parametrize(
    ("failure", "category"),
    [
        (ImageUnavailable("registry_unauthorized", "r/t1: unauthorized", hint="docker login r"),
         "registry_unauthorized"),
        (RegistryError("pulling r/t1 kept failing for 600s: 503", hint="docker login r"), "registry_error"),
    ],
)  # fmt: skip
def test_a_registry_fault_on_a_node_keeps_its_category_and_exit_code(task_images, tmp_path, failure, category):
    backend = TaskBackend(tmp_path)
    task = backend.add(1)
    backend.engine.fail_pull[task["pull"]] = failure
    with pytest.raises(type(failure)) as raised:
        task_images.prepare_task(backend, tmp_path, PREPARED, task, "agent", Ledger())
    assert raised.value.category == category and raised.value.exit_code == failure.exit_code
    assert raised.value.one_line() == f"{socket.gethostname()}: {failure.one_line()}"


def test_a_pull_that_brings_another_image_than_the_driver_resolved_is_an_infrastructure_error(task_images, tmp_path):
    backend = TaskBackend(tmp_path)
    task = backend.add(1)
    task["id"] = "sha256:" + "0" * 64
    with pytest.raises(InfrastructureError, match=r"r/t1@sha256:r/t1 arrived as sha256:r/t1, not sha256:000000000000$"):
        task_images.prepare_task(backend, tmp_path, PREPARED, task, "agent", Ledger())
    assert backend.released == [task["pull"]]


def test_a_copy_the_driver_gave_up_before_ray_started_it_runs_nothing(monkeypatch, tmp_path):
    """The ledger answers its start with 0: the copy returns at once, with no image, sandbox or scratch folder."""
    import ray

    def nothing_else(*args: object, **kwargs: object) -> None:
        raise AssertionError("a copy given up ran something")

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(node, "_node_id", lambda: "node-2")
    monkeypatch.setattr(node, "ensure_image", nothing_else)
    monkeypatch.setattr(node, "backend_for", nothing_else)
    monkeypatch.setenv(node.SCRATCH_ENV, str(tmp_path))
    starts: list[tuple[object, ...]] = []
    ledger = SimpleNamespace(
        started=SimpleNamespace(remote=lambda *args: starts.append(args) or 0),
        wait_stop=SimpleNamespace(remote=nothing_else),
    )
    request = {"session": "s1", "run_id": "run-1", "image": {"id": IMAGE_ID, "ref": REF}}
    assert node.run_copy("run-1/abc", request, ledger, b"{}", None, None) == {"superseded": True}
    assert [args[:3] for args in starts] == [("run-1/abc", "node-2", socket.gethostname())]
    assert list(tmp_path.iterdir()) == []

"""What a cluster node does with an image and a finished copy, without Ray or an engine: the image arrives once
(by digest, or from the driver's chunks) and is checked by id; a run directory goes back as a tar in chunks
and is removed. The real cluster runs in ``tests/integration/test_cluster.py``."""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import docker.errors
import pytest

from pvisor_host.backend.cluster.node import tasks as node
from pvisor_host.backend.docker.images import ImageStore
from pvisor_host.errors import InfrastructureError
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
    """A node's Docker backend as :mod:`~pvisor_host.backend.cluster.node.images` uses it: images by id, each
    pull giving the id asked for with ``size`` bytes; removals and injections recorded."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.held: set[str] = set()
        self.removed: list[str] = []
        self.images = SimpleNamespace(has=lambda image_id: image_id in self.held)
        self.fails: BaseException | None = None

    def pull_image(self, ref: str, *, cancel: threading.Event | None = None) -> SimpleNamespace:
        if self.fails is not None:
            raise self.fails
        from pvisor_host.backend.docker.cleanup import pulled

        image_id = ref.rsplit("@", 1)[-1]
        self.held.add(image_id)
        pulled.note(image_id, ref, owner="node/1/1", session="s")  # as the Docker backend notes a pull for gc
        return SimpleNamespace(id=image_id, size=self.size, pulled=True)

    def remove_image(self, image) -> bool:
        self.held.discard(image.id)
        self.removed.append(image.id)
        return True

    def image_in_use(self, image_id: str) -> bool:
        return False

    def image_budget(self) -> int | None:
        return None

    def inject_into(self, prepared, agent_image_id: str) -> None:
        pass


def _task(n: int, budget: int | None) -> dict:
    image_id = f"sha256:{n:02d}{'ab' * 31}"  # ids that differ early, as real ones do (locks are named by a prefix)
    return {"id": image_id, "ref": f"r/t{n}:v1", "pull": f"r/t{n}@{image_id}", "size": 40, "budget": budget}


PREPARED = SimpleNamespace(image=SimpleNamespace(runtime_volume="rt"))


@pytest.fixture
def task_images(monkeypatch, tmp_path):
    """The node's task-image module, its driver's "done" answer a set the test fills, its state in tmp_path."""
    from pvisor_host.backend.cluster.node import images

    monkeypatch.setenv("PVISOR_HOST_STATE_DIR", str(tmp_path / "state"))
    done: set[str] = set()
    monkeypatch.setattr(images, "_done", lambda ledger: done)
    return SimpleNamespace(module=images, done=done)


def test_a_node_keeps_its_task_images_within_the_budget_and_the_peak_is_the_batch_s_own(task_images, tmp_path):
    backend = TaskBackend(size=100)
    prepared, done, task_images = PREPARED, task_images.done, task_images.module
    # An earlier batch without a budget left two images here.
    for n in (1, 2):
        assert task_images.prepare_task(backend, tmp_path, prepared, _task(n, None), "agent", None, "s1")
    assert task_images.status(tmp_path)["peak"] == 200
    # The next batch, one image's room: the earlier batch's go first (least recently used), its own once done.
    for n in (3, 4):
        pulled = task_images.prepare_task(backend, tmp_path, prepared, _task(n, 150), "agent", None, "s2")
        assert pulled == _task(n, 150)["id"]
        done.add(pulled)
    assert backend.removed == [_task(n, None)["id"] for n in (1, 2, 3)]
    from pvisor_host.backend.docker.cleanup import pulled

    assert pulled.pulled() == []  # the node's ledger owns its pulls: gc never takes them for a worker's garbage
    assert task_images.status(tmp_path) == {"images": 1, "bytes": 100, "peak": 100, "budget": 150}
    # Present already: no pull, nothing removed.
    assert task_images.prepare_task(backend, tmp_path, prepared, _task(4, 150), "agent", None, "s2") is None
    assert len(backend.removed) == 3


def test_an_image_an_earlier_batch_left_is_the_next_batch_s_once_it_uses_it(task_images, tmp_path):
    from pvisor_host.errors import Interrupted

    backend = TaskBackend(size=100)
    images = task_images.module
    images.prepare_task(backend, tmp_path, PREPARED, _task(1, None), "agent", None, "s1")
    assert images.prepare_task(backend, tmp_path, PREPARED, _task(1, 150), "agent", None, "s2") is None  # here
    cancel = threading.Event()
    threading.Timer(1.5, cancel.set).start()
    with pytest.raises(Interrupted):  # waits for room: image 1's items (now s2's) are not done
        images.prepare_task(backend, tmp_path, PREPARED, _task(2, 150), "agent", None, "s2", cancel)
    assert backend.removed == []
    assert images.status(tmp_path)["images"] == 1  # and no reservation is left for image 2


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), RuntimeError("engine gone")])
def test_a_pull_that_fails_in_any_way_leaves_no_reservation(task_images, tmp_path, failure):
    backend = TaskBackend(size=100)
    backend.fails = failure
    with pytest.raises(type(failure)):
        task_images.module.prepare_task(backend, tmp_path, PREPARED, _task(1, 150), "agent", None, "s1")
    assert task_images.module.status(tmp_path)["images"] == 0


def test_a_registry_refusal_on_a_node_keeps_its_category(task_images, tmp_path):
    from pvisor_host.errors import ImageUnavailable

    backend = TaskBackend(size=100)
    backend.fails = ImageUnavailable("registry_unauthorized", "r/t1: unauthorized", hint="docker login r")
    with pytest.raises(ImageUnavailable) as raised:
        task_images.module.prepare_task(backend, tmp_path, PREPARED, _task(1, 150), "agent", None, "s1")
    assert raised.value.category == "registry_unauthorized"
    assert raised.value.one_line().endswith(": r/t1: unauthorized (docker login r)")


def test_a_reservation_of_a_process_that_is_gone_is_dropped(task_images, tmp_path):
    images = task_images.module
    state = {"images": {"sha256:1": {"size": 5, "used": 0, "pulling": "1/0", "session": "s"}}, "peak": 0}
    (tmp_path / images.LEDGER).write_text(json.dumps(state))  # pid 1, but not started at tick 0
    assert images.status(tmp_path)["images"] == 0
    state["images"]["sha256:1"]["pulling"] = images._me()  # this process: alive
    (tmp_path / images.LEDGER).write_text(json.dumps(state))
    assert images.status(tmp_path)["images"] == 1


def test_a_batch_with_a_budget_trims_what_earlier_batches_left_even_when_it_pulls_nothing(task_images, tmp_path):
    backend = TaskBackend(size=100)
    images = task_images.module
    for n in (1, 2):  # an earlier batch, without a budget
        images.prepare_task(backend, tmp_path, PREPARED, _task(n, None), "agent", None, "s1")
    task_images.done.add(_task(2, None)["id"])  # even said to be done, the image in use stays
    assert images.prepare_task(backend, tmp_path, PREPARED, _task(2, 50), "agent", None, "s2") is None  # here
    assert backend.removed == [_task(1, None)["id"]]  # the other one the earlier batch left, not the one in use
    assert _task(2, None)["id"] in backend.held
    assert images.status(tmp_path) == {"images": 1, "bytes": 100, "peak": 100, "budget": 50}


def test_an_image_another_copy_is_about_to_use_is_not_removed(task_images, tmp_path):
    backend = TaskBackend(size=100)
    images = task_images.module
    for n in (1, 2):
        images.prepare_task(backend, tmp_path, PREPARED, _task(n, None), "agent", None, "s1")
    with images._locked(images._image_lock(tmp_path, _task(1, None)["id"])):  # a copy found image 1 here
        images.prepare_task(backend, tmp_path, PREPARED, _task(2, 150), "agent", None, "s2")
    assert backend.removed == []  # over the budget for now, but image 1 is about to run

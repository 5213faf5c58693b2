"""A cluster driver's task images (:class:`TaskImages`), resolved against a fake registry through a real
:class:`Puller`: the digest nodes pull, the image's id, size and layers, the registry's failures ending as a
pull's would (retried, final, or an outage past the attempts), and nothing asked twice. tenacity's backoff is
made 0 s, so retries sleep for nothing."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pvisor_host.backend.cluster.task_images import TaskImages
from pvisor_host.backend.docker.image.cache.layers import chain_ids
from pvisor_host.backend.docker.image.mirrors import Mirrors
from pvisor_host.backend.docker.image.pull import ATTEMPTS, PATIENCE_ENV, Puller
from pvisor_host.backend.docker.image.registry import ManifestError, ManifestInfo
from pvisor_host.errors import ExitCode, ImageUnavailable, Interrupted, RegistryError
from pvisor_host.models.image import PulledImage

REF = "127.0.0.1:5000/task/t1:v1"
DIGEST = "sha256:" + "ab" * 32
CONFIG_DIGEST = "sha256:" + "cd" * 32
DIFF_IDS = ["sha256:" + "d1" * 32, "sha256:" + "d2" * 32]
LAYERS = [("sha256:" + "01" * 32, 100 * 2**20), ("sha256:" + "02" * 32, 20 * 2**20)]
CONFIG_BYTES = 1234
OUTAGE = ManifestError("127.0.0.1:5000: cannot reach the registry (ConnectionError)")


class FakeRegistries:
    """A registry's answers to a resolve's two questions (the manifest, then the configuration it names), each
    question recorded in ``asked``. The manifest question raises ``failures`` first, in order, and always
    fails while ``down``."""

    def __init__(
        self,
        *,
        architecture: str = "amd64",
        failures: list[ManifestError] | None = None,
        mirrors: Mirrors | None = None,
    ) -> None:
        self.mirrors = mirrors or Mirrors()
        self.asked: list[tuple[str, str]] = []
        self.failures = list(failures or [])
        self.down = False
        self.answer = ManifestInfo(DIGEST, LAYERS, CONFIG_BYTES, CONFIG_DIGEST)
        self.configuration: dict[str, Any] = {
            "os": "linux",
            "architecture": architecture,
            "config": {"Labels": {"org.example.env": "py311"}, "User": "swe"},
            "rootfs": {"type": "layers", "diff_ids": DIFF_IDS},
        }

    def manifest(self, reference: str) -> ManifestInfo:
        self.asked.append(("manifest", reference))
        if self.down:
            raise OUTAGE
        if self.failures:
            raise self.failures.pop(0)
        return self.answer

    def config(self, reference: str, manifest: ManifestInfo) -> dict[str, Any]:
        self.asked.append(("config", reference))
        assert manifest is self.answer
        return self.configuration


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    """Retries without waiting: tenacity's wait is 0 s, so ``pull._sleep`` sleeps 0 s; and the default patience
    (not a shorter one from the environment), so an outage ends after ATTEMPTS questions, not a deadline."""
    monkeypatch.setattr(Puller, "_backoff", staticmethod(lambda state: 0.0))
    monkeypatch.delenv(PATIENCE_ENV, raising=False)


def images_for(registries: FakeRegistries) -> TaskImages:
    # No engine client: a lookup never touches the engine.
    return TaskImages(Puller(client=None, registries=registries))  # type: ignore[arg-type]


def test_a_resolve_gives_the_digest_nodes_pull_the_configuration_as_id_and_the_bytes_a_pull_downloads():
    registries = FakeRegistries()
    images = images_for(registries)
    found = images.resolve(REF)
    assert found == PulledImage(
        ref=REF, id=CONFIG_DIGEST, digest=f"127.0.0.1:5000/task/t1@{DIGEST}", size=120 * 2**20 + CONFIG_BYTES
    )
    assert images.layers(REF) == dict(zip(chain_ids(DIFF_IDS), [100 * 2**20, 20 * 2**20], strict=True))
    assert registries.asked == [("manifest", REF), ("config", REF)]


def test_an_image_not_resolved_has_no_layers():
    assert images_for(FakeRegistries()).layers(REF) == {}


def test_a_resolved_image_is_kept_and_the_registry_is_not_asked_again():
    registries = FakeRegistries()
    images = images_for(registries)
    first = images.resolve(REF)
    asked = list(registries.asked)
    assert images.resolve(REF) is first
    assert registries.asked == asked


def test_nodes_pull_from_where_the_image_really_comes_from():
    registries = FakeRegistries(mirrors=Mirrors.parse(mirror="mirror.internal:5000"))
    found = images_for(registries).resolve("python:3.11")
    assert found.ref == "python:3.11"
    assert found.digest == f"mirror.internal:5000/library/python@{DIGEST}"


def test_two_outages_are_retried_and_the_third_answer_resolves_the_image():
    registries = FakeRegistries(failures=[OUTAGE, OUTAGE])
    found = images_for(registries).resolve(REF)
    assert found.id == CONFIG_DIGEST
    assert registries.asked == [("manifest", REF)] * 3 + [("config", REF)]


@pytest.mark.parametrize(
    ("status", "category"),
    [(404, "image_not_found"), (401, "registry_unauthorized"), (403, "registry_unauthorized")],
)
def test_a_final_refusal_is_the_images_own_failure_asked_once(status, category):
    registries = FakeRegistries(failures=[ManifestError(f"{REF}: the registry answered HTTP {status}", status=status)])
    with pytest.raises(ImageUnavailable) as raised:
        images_for(registries).resolve(REF)
    assert raised.value.category == category
    assert registries.asked == [("manifest", REF)]


def test_an_image_that_is_not_linux_amd64_is_unusable():
    registries = FakeRegistries(architecture="arm64")
    images = images_for(registries)
    with pytest.raises(ImageUnavailable) as raised:
        images.resolve(REF)
    assert raised.value.category == "image_unusable"
    assert f"task image {REF} is linux/arm64" in raised.value.message
    assert images.layers(REF) == {}


def test_an_outage_past_the_attempts_ends_as_a_failed_pull_does():
    registries = FakeRegistries()
    registries.down = True
    with pytest.raises(RegistryError) as raised:
        images_for(registries).resolve(REF)
    assert registries.asked == [("manifest", REF)] * ATTEMPTS
    assert raised.value.category == "registry_error"
    assert raised.value.exit_code == RegistryError(f"pulling {REF} failed").exit_code == ExitCode.INFRASTRUCTURE
    assert raised.value.message.startswith(f"asking the registry for {REF} kept failing for ")


def test_a_cancelled_resolve_asks_nothing():
    registries = FakeRegistries()
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Interrupted):
        images_for(registries).resolve(REF, cancel=cancel)
    assert registries.asked == []

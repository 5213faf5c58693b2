"""The CLI is a thin layer over the models: every replay option is a field of the spec (or builds the image),
so no flag can be silently dropped on its way down, and ``batch`` offers the same ones as item defaults."""

from __future__ import annotations

import inspect

from pvisor_host.cli import app as cli
from pvisor_host.models.spec import MODEL_OPTIONS, ReplaySpec

#: Options of ``replay`` that are not about the replay itself but about the image it may build, or the output.
NOT_SPEC = {"base", "ca_bundle", "json_output"}
#: Options of ``batch`` that are about the batch (or its input), not defaults for its items.
BATCH_OWN = {"manifest_file", "manifest", "trajectories", "after_step", "out", "workers", "deadline", "rerun_failed",
             "retry_oom", "allow_failures", "plan", "baseline", "cluster", "registry", "quiet", "json_output", "base",
             "ca_bundle"}  # fmt: skip
SPEC_FIELDS = set(ReplaySpec.model_fields) - {"upstream"} | set(MODEL_OPTIONS) | {"no_model_bodies"}


def parameters(command: object) -> set[str]:
    return set(inspect.signature(command).parameters)  # type: ignore[arg-type]


def test_every_replay_option_is_a_spec_field_and_every_field_an_option():
    options = parameters(cli.replay) - NOT_SPEC
    assert options == SPEC_FIELDS


def test_batch_offers_every_replay_option_but_those_each_item_sets_itself():
    per_item = {"trajectory", "after_step", "out", "run_id", "session_id"}
    assert parameters(cli.batch) - BATCH_OWN == SPEC_FIELDS - per_item


def test_replay_passes_every_option_to_the_spec_by_name():
    source = inspect.getsource(cli.replay)
    for name in parameters(cli.replay) - NOT_SPEC:
        assert f"{name}={name}," in source, name

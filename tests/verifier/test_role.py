"""The verifier's own settings and its role on the worker server."""

from __future__ import annotations

import pytest

from coordinator.fleet.polling import wait_until
from specmesh.runtime.engine import as_engine
from specmesh.worker.config import ModelConfig, ServerConfig
from specmesh.worker.cost_probe import PROBE_VERIFY_DRAFTS
from specmesh.worker.role import ModelDescription
from verifier.config import BatchingConfig, VerifierConfig
from verifier.service import VerifierRole


@pytest.mark.parametrize("options, message", [
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(max_batch_wait_s=-0.1), "max_batch_wait_s"),
    (dict(max_batch_wait_s=11), "max_batch_wait_s"),
])
def test_batching_config_refuses_what_cannot_work(options, message):
    with pytest.raises(ValueError, match=message):
        BatchingConfig(**options)


def test_role_builds_a_verify_engine_with_its_settings_and_reports_measured_costs(tiny_target):
    # Batching needs the non-deterministic mode (a deterministic engine runs one session a pass).
    role = VerifierRole(VerifierConfig(ModelConfig(tiny_target.name, deterministic=False),
                                       BatchingConfig(max_batch_size=3, max_batch_wait_s=0.5)),
                        preloaded=tiny_target)
    engine = role.build_engine(ServerConfig())
    assert (engine.max_batch_size, engine.max_batch_wait_s) == (3, 0.5)
    assert engine.description == ModelDescription.of(as_engine(tiny_target))
    assert role.info_fields(engine) == {"verify_base_s": 0.0, "verify_per_draft_s": 0.0,
                                        "verify_costs": []}  # not measured yet
    engine.warm_up()
    # Not cached (a tiny test model has no model file): measured in the background after warm-up.
    assert wait_until(lambda: engine.verify_costs, timeout_s=30)
    fields = role.info_fields(engine)
    assert fields["verify_base_s"] > 0 and fields["verify_per_draft_s"] >= 0
    # The cost curve at every probed draft count, the line's base among them.
    assert [c.drafts for c in fields["verify_costs"]] == list(PROBE_VERIFY_DRAFTS)
    assert fields["verify_costs"][0].seconds == fields["verify_base_s"]
    assert all(c.seconds > 0 for c in fields["verify_costs"])
    assert len(engine.sessions) == 0  # the warm-up and the cost probe leave no session behind

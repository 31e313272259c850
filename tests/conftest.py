import pytest

from specmesh.runtime.models import load_model


def pytest_configure(config):
    config.addinivalue_line("markers", "kills_real_pair: kills workers of the shared real pair (runs after every "
                            "other test that uses it)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # The real default pair is started once per session (real_pair below); the tests that kill its workers run after
    # every other test (a stable sort keeps the rest in order). With pytest-xdist, every real-model test goes to
    # one worker process (--dist loadgroup), so that the pair is started once and never twice side by side.
    items.sort(key=lambda item: item.get_closest_marker("kills_real_pair") is not None)
    for item in items:
        if item.get_closest_marker("real_models"):
            item.add_marker(pytest.mark.xdist_group("real_models"))


@pytest.fixture(scope="session")
def real_pair(tmp_path_factory):
    """The real default pair in float32 (exact greedy), started once for every real-model test: a verifier with a
    metrics endpoint (`real_pair.metrics_port`) and a drafter. Tests that need more workers add them to
    `real_pair.workers` (the chaos tests add a second verifier), and all are stopped at the end of the session."""
    from coordinator.local_workers import LocalWorker, LocalWorkerSpec, free_port
    from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
    from tests.chaos.conftest import Fleet

    fleet = Fleet(str(tmp_path_factory.mktemp("real-pair")), DEFAULT_TARGET_MODEL, DEFAULT_DRAFT_MODEL, "float32")
    fleet.metrics_port = free_port()
    specs = [LocalWorkerSpec("verifier", DEFAULT_TARGET_MODEL, "cpu", "float32",
                             extra_args=("--metrics-port", str(fleet.metrics_port))),
             LocalWorkerSpec("drafter", DEFAULT_DRAFT_MODEL, "cpu", "float32")]
    try:
        for spec in specs:
            fleet.workers.append(LocalWorker(spec, fleet.log_dir))
        for worker in fleet.workers:
            worker.wait_serving(timeout_s=900)
        yield fleet
    finally:
        fleet.stop_all()


@pytest.fixture(scope="session")
def tiny_target():
    return load_model("tiny-random-qwen2", device="cpu", dtype="float64")


@pytest.fixture(scope="session")
def tiny_unrelated_draft():
    return load_model("tiny-random-qwen2-b", device="cpu", dtype="float64")


@pytest.fixture(scope="session")
def tiny_other_tokenizer():
    return load_model("tiny-random-llama", device="cpu", dtype="float64")

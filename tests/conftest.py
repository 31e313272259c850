import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from specmesh.runtime.models import load_model


def _fixed_hypothesis() -> None:
    """Hypothesis draws the same examples on every run, so that `make test` is red only for a change that breaks
    something (the randomized, open-ended campaign is scripts/fuzz.py): each test's examples come from a seed derived
    from the test itself (derandomize), no example database is read or written (.hypothesis/ is not committed), and
    no health check depends on timing. tests/test_fuzz.py also says so in its own settings.

    One more source of variation: now and then hypothesis draws a constant it collects from the project's (non-test)
    modules loaded in the process, and which are loaded depends on the tests this process ran before (pytest-xdist
    deals the files out by timing). That pool is pinned empty here, for every test of the process (it is a
    process-wide cache); tests/test_fuzz.py checks that the pin holds with the installed hypothesis."""
    settings.register_profile("fixed", derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("fixed")
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # a hypothesis without the pool
        return
    if hasattr(providers, "_get_local_constants") and hasattr(providers, "CONSTANTS_CACHE"):
        nothing = Constants()
        providers._get_local_constants = lambda: nothing
        providers.CONSTANTS_CACHE.cache.clear()


_fixed_hypothesis()

# Every process a test starts inherits this variable (a name outside SPECMESH_*, which local workers do not pass on):
# at the end of the session, any process still carrying this run's value was left behind, even one whose parent has
# died and which now belongs to PID 1. With pytest-xdist each test process marks and checks its own.
RUN_MARK = "PYTEST_SPECMESH_RUN"
LEAK_WAIT_S = 20.0  # how long stragglers may take to finish stopping (a worker's grace period, a parent's lifeline)


def _alive(pid: int) -> bool:
    """Running (or stopped), not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _parents() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass  # gone meanwhile
    return parents


def left_behind(mark: str) -> list[int]:
    """Live processes, other than this one, that descend from it or carry `mark` in their environment."""
    me, parents = os.getpid(), _parents()
    found = set()
    for pid in parents:
        ancestor, seen = parents.get(pid), 0
        while ancestor and ancestor != me and seen < 64:
            ancestor, seen = parents.get(ancestor), seen + 1
        if ancestor == me:
            found.add(pid)
        elif pid != me:
            try:
                if f"{RUN_MARK}={mark}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.add(pid)
            except OSError:
                pass  # gone meanwhile, or not ours to read
    return sorted(pid for pid in found if _alive(pid))


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


# A probe waits while other processes compute (specmesh/worker/cost_probe.py): pytest-xdist's other test process
# always may, so the tests' workers, in this process or started by it, measure without waiting. The waiting itself is
# tested with a given reading of the machine (tests/specmesh/worker/test_cost_probe.py).
os.environ["SPECMESH_PROBE_QUIET_SAMPLE_S"] = "0"
# What a coordinator learns of its workers is kept in a file for the next processes (coordinator/drafting/
# learning_store.py): here each test's coordinators start from nothing, whatever tests ran before them (or ran beside
# them, in pytest-xdist's other process). Keeping it is tested with a store of its own (tests/coordinator/drafting/
# test_learning_store.py).
os.environ["SPECMESH_LEARNING_CACHE"] = "0"


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """A test run leaves no process running: checked once every test (and fixture) of this process has finished."""
    mark = uuid.uuid4().hex
    os.environ[RUN_MARK] = mark
    yield
    deadline = time.monotonic() + LEAK_WAIT_S
    while (stragglers := left_behind(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if stragglers:
        described = [f"{pid}: {_command_line(pid)}" for pid in stragglers]
        for pid in stragglers:
            try:
                os.kill(pid, signal.SIGKILL)  # this run's own processes: do not leave them to the next one
            except OSError:
                pass
        pytest.fail("processes started by the tests were still running at the end of the session:\n"
                    + "\n".join(described), pytrace=False)


@pytest.fixture(scope="session")
def tiny_target():
    return load_model("tiny-random-qwen2", device="cpu", dtype="float64")


@pytest.fixture(scope="session")
def tiny_unrelated_draft():
    return load_model("tiny-random-qwen2-b", device="cpu", dtype="float64")


@pytest.fixture(scope="session")
def tiny_other_tokenizer():
    return load_model("tiny-random-llama", device="cpu", dtype="float64")

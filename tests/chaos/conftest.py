"""Chaos-test fixtures: real worker subprocesses (tiny float64 models, seconds to start) that tests kill for real."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from coordinator.fleet.local_workers import LocalWorker, LocalWorkerSpec
from coordinator.fleet.polling import wait_until
from specmesh.runtime.models import load_model
from tests.helpers import reference_greedy

TARGET, DRAFT = "tiny-random-qwen2", "tiny-random-qwen2-b"
PROMPT_TEXT = "def fibonacci(n):\n    "
MAX_NEW = 48


class Fleet:
    """Starts workers as subprocesses and stops whatever is left at the end of the test. Tiny float64 models by
    default; `target`, `draft`, `dtype`, `engine` and `extra` (flags for every worker) choose others."""

    def __init__(self, log_dir: str, target: str = TARGET, draft: str = DRAFT, dtype: str = "float64",
                 engine: str = "auto", extra: tuple[str, ...] = (), load_timeout_s: float = 120.0) -> None:
        self.log_dir = log_dir
        self.workers: list[LocalWorker] = []
        self.models = {"verifier": target, "drafter": draft}
        self.dtype, self.engine, self.extra, self.load_timeout_s = dtype, engine, extra, load_timeout_s

    def start(self, role: str, model: str | None = None, port: int = 0, extra: tuple[str, ...] = (),
              wait: bool = True) -> LocalWorker:
        spec = LocalWorkerSpec(role, model or self.models[role], "cpu", self.dtype, threads=1, port=port,
                               engine=self.engine, extra_args=(*self.extra, *extra))
        worker = LocalWorker(spec, self.log_dir)
        self.workers.append(worker)
        if wait:
            worker.wait_serving(self.load_timeout_s)
        return worker

    def by_address(self, address: str) -> LocalWorker:
        return next(w for w in self.workers if w.address == address and w.process.poll() is None)

    def stop_all(self) -> None:
        for worker in self.workers:
            worker.stop(timeout_s=5)


@contextmanager
def running_fleet(**options) -> Iterator[Fleet]:
    """A Fleet whose workers are all stopped, and their logs removed, on exit."""
    with tempfile.TemporaryDirectory(prefix="specmesh-fleet-") as log_dir:
        f = Fleet(log_dir, **options)
        try:
            yield f
        finally:
            f.stop_all()


@pytest.fixture
def fleet():
    with running_fleet() as f:
        yield f


@pytest.fixture(scope="session")
def tiny():
    return load_model(TARGET, device="cpu", dtype="float64")


@pytest.fixture(scope="session")
def prompt(tiny):
    return tiny.tokenizer(PROMPT_TEXT)["input_ids"]


@pytest.fixture(scope="session")
def expected(tiny, prompt):
    tokens = reference_greedy(tiny.model, prompt, MAX_NEW, set(tiny.eos_token_ids))
    assert len(tokens) >= 20, "the chaos prompt must generate long enough to be interrupted"
    return tokens


def poll(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Wait for `condition` by polling (never a fixed sleep); fail with `what` after timeout_s."""
    if not wait_until(condition, timeout_s, interval_s=0.02):
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def once(action: Callable[[], None], after_calls: int = 1) -> Callable[[str], None]:
    """An on_text callback that runs `action` once, on its `after_calls`-th call, inside the generation."""
    calls = []

    def callback(text: str) -> None:
        calls.append(text)
        if len(calls) == after_calls:
            action()
    return callback

"""Chaos-test fixtures: real worker subprocesses (tiny float64 models, seconds to start) that tests kill for real."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable

import pytest

from coordinator.workers import LocalWorker, LocalWorkerSpec
from specmesh.models import load_model
from tests.helpers import reference_greedy

TARGET, DRAFT = "tiny-random-qwen2", "tiny-random-qwen2-b"
PROMPT_TEXT = "def fibonacci(n):\n    "
MAX_NEW = 48


class Fleet:
    """Starts workers as subprocesses and stops whatever is left at the end of the test."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.workers: list[LocalWorker] = []

    def start(self, role: str, model: str | None = None, port: int = 0, extra: tuple[str, ...] = (),
              wait: bool = True) -> LocalWorker:
        spec = LocalWorkerSpec(role, model or (TARGET if role == "verifier" else DRAFT), "cpu", "float64",
                               threads=1, port=port, extra_args=extra)
        worker = LocalWorker(spec, self.log_dir)
        self.workers.append(worker)
        if wait:
            worker.wait_serving()
        return worker

    def by_address(self, address: str) -> LocalWorker:
        return next(w for w in self.workers if w.address == address and w.process.poll() is None)

    def stop_all(self) -> None:
        for worker in self.workers:
            worker.stop(timeout_s=5)


@pytest.fixture
def fleet():
    with tempfile.TemporaryDirectory(prefix="specmesh-chaos-") as log_dir:
        f = Fleet(log_dir)
        try:
            yield f
        finally:
            f.stop_all()


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
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def once(action: Callable[[], None], after_calls: int = 1) -> Callable[[str], None]:
    """An on_text callback that runs `action` once, on its `after_calls`-th call, inside the generation."""
    calls = []

    def callback(text: str) -> None:
        calls.append(text)
        if len(calls) == after_calls:
            action()
    return callback

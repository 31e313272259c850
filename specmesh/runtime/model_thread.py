"""One thread for every forward pass of a worker, the process's main thread where it can be.

gRPC runs each call on whichever pool thread took it. Torch work issued from many threads costs more, and not only
the forward passes: every thread that runs a parallel torch op (an argmax or softmax over a 150k-wide vocabulary is
one) gets an OpenMP team of its own, and once a process has more OpenMP threads than cores, libgomp stops
spin-waiting between parallel regions (its "throttled" spin count). The model's own team then sleeps and wakes
hundreds of times per forward pass. Measured on the 1.5B target in float32 on 2 cores: 277-311 ms per token, 375-387
ms while one other thread holds a team (1.98 cores busy vs 1.55), and back once that thread ends. So a worker hands
all of its torch work, forward passes, sampling and acceptance alike, to one thread (`ModelEngine.run_on_model_thread`):
its main thread (`serve_on_main_thread`, from `drafter serve` / `verifier serve`); engines built in any other setting
(tests, embedding) get a dedicated thread of their own. Either way there is exactly one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

_main_queue: queue.SimpleQueue | None = None  # set by use_main_thread(): work for the main thread


def use_main_thread() -> None:
    """From now on, model threads run their work on the main thread, which must call serve_on_main_thread."""
    global _main_queue
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("use_main_thread must be called from the main thread")
    _main_queue = _main_queue or queue.SimpleQueue()


def uses_main_thread() -> bool:
    """Whether model threads run their work on the main thread (use_main_thread was called)."""
    return _main_queue is not None


def serve_on_main_thread(stop: threading.Event, poll_s: float = 0.2) -> None:
    """Run queued work on this (the main) thread until `stop` is set."""
    if _main_queue is None:
        raise RuntimeError("call use_main_thread first")
    while not stop.is_set():
        try:
            future, fn, args, kwargs = _main_queue.get(timeout=poll_s)  # wakes to let signal handlers run
        except queue.Empty:
            continue
        _run(future, fn, args, kwargs)


def _run(future: Future, fn: Callable, args: tuple, kwargs: dict) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as e:  # handed to the caller, which re-raises it
        future.set_exception(e)


class ModelThread:
    def __init__(self, name: str) -> None:
        if _main_queue is not None:
            self._queue, self._ident = _main_queue, threading.main_thread().ident
            return
        self._queue = queue.SimpleQueue()
        thread = threading.Thread(target=self._serve, name=name, daemon=True)
        thread.start()
        self._ident = thread.ident

    def _serve(self) -> None:
        while True:
            _run(*self._queue.get())

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on the model thread (directly when already on it: nested calls must not deadlock)."""
        if threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        future: Future = Future()
        self._queue.put((future, fn, args, kwargs))
        return future.result()

"""What both chaos scenarios share (scripts/chaos.py, and scripts/chaos_serve.py behind `chaos.py --serve`): the
prompts, the worker slots that survive their process being killed and restarted on the same port, the log line and
the nearest-rank percentile. Its own module so that neither scenario imports the other's module for them."""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time

from coordinator.fleet.local_workers import LocalWorker, LocalWorkerSpec
from coordinator.fleet.worker_client import WorkerError

PROMPTS = [
    "def fibonacci(n):\n    ",
    "Write a Python function that checks whether a number is prime.",
    "SELECT name, total FROM orders WHERE",
    "The quick brown fox",
]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Slot:
    """One worker position (role, port) that survives its process being killed and restarted."""

    def __init__(self, name: str, spec: LocalWorkerSpec, log_dir: str) -> None:
        self.name, self.spec, self.log_dir = name, spec, log_dir
        self.worker: LocalWorker | None = None
        self.up = threading.Event()  # a process is running and was SERVING when last checked
        self.restarter: threading.Thread | None = None
        self.restarts = 0
        self.restart_s: list[float] = []  # signal to SERVING again
        self.restart_deadline = 0.0
        self.on_up = None  # called (on the restart thread) once a restarted process is SERVING
        self.restart_failures = 0
        self.lock = threading.Lock()
        self.closing = threading.Event()  # set by stop(): no restart may start a process any more

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.spec.port}"

    def start(self, wait: bool = True) -> None:
        self.worker = LocalWorker(self.spec, self.log_dir)
        if self.spec.port == 0:  # keep the port the first process chose: restarts come back on the same address
            self.spec = dataclasses.replace(self.spec, port=self.worker.port)
        if wait:
            self.worker.wait_serving()
            self.up.set()

    def signal(self, signum: int, restart_delay_s: float, grace_s: float, deadline: float) -> bool:
        """Send the signal, then (on a thread) wait for the exit and start a new process on the same port."""
        if not self.lock.acquire(blocking=False):  # a restart is starting a process: never stall a generation
            return False
        try:
            if not self.up.is_set() or self.worker is None or self.closing.is_set():
                return False
            self.up.clear()
            process = self.worker.process
            process.send_signal(signum)
            self.signalled_at = time.monotonic()
            self.restart_deadline = deadline
            self.restarter = threading.Thread(target=self._restart, args=(process, restart_delay_s, grace_s, deadline),
                                              name=f"restart-{self.name}", daemon=True)
            self.restarter.start()
            return True
        finally:
            self.lock.release()

    def _restart(self, process, delay_s: float, grace_s: float, deadline: float) -> None:
        try:
            process.wait(timeout=grace_s + 5)
        except Exception:
            process.kill()
            process.wait()
        self.worker.stop(timeout_s=1)  # closes its log handle
        time.sleep(delay_s)
        for attempt in range(5):  # the port may take a moment to be free again
            if time.monotonic() > deadline or self.closing.is_set():
                break
            try:
                with self.lock:
                    if self.closing.is_set():
                        return
                    self.start(wait=False)  # under the lock: stop() either sees this process or prevents it
                self.worker.wait_serving(timeout_s=max(1.0, deadline - time.monotonic()))
                self.restarts += 1
                self.restart_s.append(time.monotonic() - self.signalled_at)
                self.up.set()
                if self.on_up is not None:
                    self.on_up(self)
                return
            except WorkerError as e:
                if self.closing.is_set():
                    return
                log(f"  restart of {self.name} failed (attempt {attempt + 1}): {str(e).splitlines()[0]}")
                if self.worker is not None:
                    self.worker.stop(timeout_s=1)
                time.sleep(0.5)
        self.restart_failures += 1

    def stop(self) -> None:
        with self.lock:
            self.closing.set()
            worker = self.worker
        if worker is not None:
            worker.stop(timeout_s=5)  # a restart waiting for this process to serve sees it exit and gives up
        if self.restarter is not None:
            self.restarter.join(timeout=15)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))  # nearest rank
    return round(ordered[rank], 3)

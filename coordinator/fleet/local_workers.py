"""Local drafter and verifier subprocesses, for `coordinator generate` without addresses, benchmarks and tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from coordinator.fleet.polling import wait_until
from coordinator.fleet.worker_client import RemoteWorker, WorkerError

# The environment variables of the coordinator's that its local workers get (specmesh/worker/cost_probe.py reads
# SPECMESH_COST_CACHE and SPECMESH_PROBE_QUIET_SAMPLE_S, a worker's start SPECMESH_HUGE_PAGES, the ik engine's binding
# SPECMESH_IK_BUILD; a worker started by hand reads them from its own environment).
SHARED_VARIABLES = ("SPECMESH_TOKEN", "SPECMESH_TOKEN_FILE", "SPECMESH_CACHE_DIR", "SPECMESH_COST_CACHE",
                    "SPECMESH_PROBE_QUIET_SAMPLE_S", "SPECMESH_HUGE_PAGES", "SPECMESH_IK_BUILD")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for a worker's --metrics-port, which must be known in advance)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LocalWorkerSpec:
    role: str
    model: str
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    port: int = 0  # 0: a free port chosen by the worker
    engine: str = "auto"  # transformers | llamacpp | auto (llama.cpp for GGUF models on CPU)
    extra_args: tuple[str, ...] = ()
    name: str = ""  # its key among the addresses local_workers yields, and its log's name (default: the role)

    @property
    def key(self) -> str:
        return self.name or self.role


class LocalWorker:
    """A `drafter serve` / `verifier serve` subprocess on a free loopback port."""

    def __init__(self, spec: LocalWorkerSpec, log_dir: str) -> None:
        self.spec = spec
        self.log_path = os.path.join(log_dir, f"{spec.key}.log")
        self._log = open(self.log_path, "ab")
        command = [sys.executable, "-m", spec.role, "serve", "--model", spec.model, "--host", "127.0.0.1",
                   "--port", str(spec.port), "--device", spec.device, "--dtype", spec.dtype, "--engine", spec.engine,
                   "--grace", "1", "--exit-on-stdin-eof",
                   *spec.extra_args]
        if spec.threads:
            command += ["--threads", str(spec.threads)]
        # The coordinator's own SPECMESH_* flag variables (a metrics port, say) are not the worker's; the token, the
        # model cache and the cost probe's settings are shared.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_") or k in SHARED_VARIABLES}
        # The worker dies with this process however it ends (even SIGKILL): its stdin is a pipe only this process
        # holds, and --exit-on-stdin-eof stops it when the pipe closes (specmesh/worker/lifeline.py says why not
        # PR_SET_PDEATHSIG). Its own process group keeps a terminal's Ctrl-C away from it: the parent decides
        # when its workers stop (a Ctrl-C'd `coordinator serve` drains its requests first).
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.PIPE,
                                        env=env, process_group=0)
        # The address is read as the worker prints it (after its imports, seconds): workers started one after the
        # other load side by side, and the first use of `address` waits for it.
        self._found: list[str] = []
        self._address: str | None = None
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        for raw in self.process.stdout:
            line = raw.decode(errors="replace").strip()
            if line.startswith("LISTENING ") and not self._found:
                self._found.append(line.split(" ", 1)[1])
            # keep draining stdout so the worker never blocks on a full pipe

    @property
    def address(self) -> str:
        if self._address is None:
            self._address = self._read_address(timeout_s=300.0)  # alive but slow (a loaded machine): keep waiting
        return self._address

    def _read_address(self, timeout_s: float) -> str:
        wait_until(lambda: self._found or self.process.poll() is not None, timeout_s)
        if not self._found:
            self.stop()
            raise WorkerError(f"{self.spec.key} did not start; its log:\n{self.log_tail()}")
        return self._found[0]

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def begin_stop(self) -> None:
        """SIGTERM, without waiting: workers stopped together end together (each takes about half a second, most of
        it the interpreter's teardown of torch)."""
        if self.process.poll() is None:
            self.process.terminate()

    def kill(self) -> None:
        """SIGKILL, and wait until the process is really gone."""
        self.process.kill()
        self.process.wait()
        self._close_lifeline()

    def _close_lifeline(self) -> None:
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()

    def wait_serving(self, timeout_s: float = 120.0, on_wait: Callable[[], None] | None = None) -> None:
        """Wait until the worker reports SERVING; WorkerError at once if the process exits first."""
        def still_running() -> None:
            if self.process.poll() is not None:
                raise WorkerError(f"{self.spec.key} exited with status {self.process.returncode} before it was ready")
            if on_wait is not None:
                on_wait()

        client = RemoteWorker(self.address, self.spec.role)
        try:
            client.wait_serving(timeout_s, on_wait=still_running)
        finally:
            client.close()

    def wait_costs(self, timeout_s: float = 120.0) -> None:
        """Wait until the worker reports its costs: measured after SERVING, in the background, when not cached."""
        client = RemoteWorker(self.address, self.spec.role)
        try:
            client.wait_costs(timeout_s)
        finally:
            client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.begin_stop()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_lifeline()
        if not self._log.closed:
            self._log.close()


@contextmanager
def local_workers(specs: list[LocalWorkerSpec], progress: bool = True, load_timeout_s: float = 1800.0,
                  one_at_a_time: bool = False,
                  while_loading: Callable[[], None] | None = None) -> Iterator[dict[str, str]]:
    """Start one subprocess per spec, wait until every one reports SERVING, yield {role: address}; stop them after.

    `one_at_a_time`: start each worker only once the previous one is SERVING and has measured its costs (which it
    does after SERVING when they are not cached), and yield once the last one has. Slower to start, but each
    worker's cost probe (the cost policy's prior) then runs on a quiet machine instead of beside a neighbour that is
    still loading its model, which made drafting look unprofitable, and every coordinator starts from the workers'
    costs (benchmarks use it).
    `while_loading`: called once the workers are started, before waiting for them (the caller's own slow imports and
    checks, done while the workers load; what it raises stops them)."""
    with ExitStack() as stack:
        log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="specmesh-"))
        workers = []

        def start(spec: LocalWorkerSpec) -> LocalWorker:
            worker = LocalWorker(spec, log_dir)
            stack.callback(worker.stop)
            workers.append(worker)
            return worker
        # One at a time: a generator, so each worker starts only when the loop below has waited for the previous one.
        to_wait = (start(spec) for spec in specs) if one_at_a_time else [start(spec) for spec in specs]
        started = time.monotonic()
        if while_loading is not None:
            while_loading()
        # A spinner only on a terminal: piped to a file or `tail`, its carriage-return frames would be hundreds of lines.
        spinner = progress and sys.stderr.isatty()
        for worker in to_wait:
            def show(worker=worker) -> None:
                if spinner:
                    print(f"\rloading {worker.spec.key} {worker.spec.model} ... {time.monotonic() - started:.0f}s",
                          end="", file=sys.stderr, flush=True)
            try:
                worker.wait_serving(load_timeout_s, on_wait=show)
                if one_at_a_time:
                    worker.wait_costs(load_timeout_s)
            except WorkerError as e:
                raise WorkerError(f"{e}; its log:\n{worker.log_tail()}") from None
            if progress:  # on a terminal it overwrites the spinner's line (the blanks cover its longer text)
                ready = f"{worker.spec.key} {worker.spec.model} ready on {worker.address} " \
                        f"({time.monotonic() - started:.0f}s)"
                print(f"\r{ready}   " if spinner else ready, file=sys.stderr, flush=True)
        # Run first on the way out (callbacks run last in, first out): every worker is told to stop before each
        # worker's stop waits for it.
        stack.callback(lambda: [worker.begin_stop() for worker in workers])
        yield {w.spec.key: w.address for w in workers}

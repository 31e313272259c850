"""A worker ends on SIGTERM or SIGINT in every state (issue 27, item 5), and says so in its log.

In process: WorkerServer.stop is idempotent and always ends (a step that raises, a gRPC server that never reports
stopped) with `terminated` set, which is what the main thread's model loop waits for; SignalStop answers the first
signal with a stop and a deadline, and a second one with an exit. As processes (tiny float64 models): SIGTERM or
SIGINT while idle, during a call, while the model thread is stuck in native code, after a stop that raised, and a
second signal during a stop that hangs, each ending the process within its bound with the signal in the log."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.fleet.polling import wait_until
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
from specmesh.wire.history import EMPTY_HASH
from specmesh.worker import lifeline, server as server_module
from specmesh.worker.lifeline import SignalStop
from specmesh.worker.server import WorkerServer, serving
from tests.helpers import wait_for_costs
from tests.specmesh.worker.test_server import FakeRole


def fail(message: str):
    raise RuntimeError(message)


def refused(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=0.5)
        except grpc.FutureTimeoutError:
            return True
    return False


# ---- WorkerServer.stop -------------------------------------------------------------------------------------------

def test_a_stop_that_raises_still_sets_terminated_and_a_second_stop_returns_at_once():
    """The state the issue suspected: a stop that began and died left `_stopped` set and `terminated` unset, so the
    main thread's model loop never ended and every later stop returned at once."""
    server = WorkerServer(FakeRole())
    server.start()
    server.load()
    real_stop = server._server.stop
    server._server.stop = lambda grace: fail("injected: grpc stop failed")
    try:
        with pytest.raises(RuntimeError, match="injected"):
            server.stop(grace=0)
        assert server.terminated.is_set() and server.stopping.is_set()
        started = time.monotonic()
        server.stop(grace=5)  # already stopped: returns at once
        assert time.monotonic() - started < 0.5
        assert server.state().startswith("stopped")
    finally:
        real_stop(None).wait(5)


def test_a_failing_shutdown_step_does_not_keep_the_server_running(caplog):
    with caplog.at_level(logging.INFO, logger="specmesh.worker.server"):
        server = WorkerServer(FakeRole())
        server.start()
        server.load()
        server.health.enter_graceful_shutdown = lambda: fail("injected: health")
        server.stop(grace=0)
    assert server.terminated.is_set()
    assert refused(server.address)
    messages = [r.getMessage() for r in caplog.records]
    assert any("a step of stopping failed" in m for m in messages), messages
    assert "verifier stopping: 0 call(s) in flight get 0 s to finish" in messages, messages
    assert any(m.startswith("verifier stopped in") for m in messages), messages


def test_stop_gives_up_on_a_grpc_server_that_never_reports_stopped(monkeypatch, caplog):
    monkeypatch.setattr(server_module, "STOP_MARGIN_S", 0.3)
    server = WorkerServer(FakeRole())
    server.start()
    server.load()
    real_stop = server._server.stop
    server._server.stop = lambda grace: threading.Event()  # never set
    try:
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="specmesh.worker.server"):
            server.stop(grace=0.2)
        assert 0.4 < time.monotonic() - started < 3.0
        assert server.terminated.is_set()
        assert any("has not stopped" in r.getMessage() for r in caplog.records)
    finally:
        real_stop(None).wait(5)


def test_concurrent_stops_stop_once_and_all_return():
    calls = []
    with serving(WorkerServer(FakeRole())) as server:
        real_stop = server._server.stop
        server._server.stop = lambda grace: calls.append(grace) or real_stop(grace)
        threads = [threading.Thread(target=server.stop, args=(0.1,)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in threads)
        assert server.terminated.wait(5) and calls[0] == 0.1 and calls.count(0.1) == 1  # (0: the quiet cancel)


def test_a_health_watch_does_not_hold_the_stop_but_a_call_in_flight_does():
    """Grace is for servicer calls: a coordinator's Watch stream, which never ends by itself, is cancelled as soon as
    no call is left, instead of holding every stop for the whole grace period."""
    with serving(WorkerServer(FakeRole())) as server, grpc.insecure_channel(server.address) as channel:
        statuses: list = []

        def watch() -> None:
            try:
                for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="")):
                    statuses.append(reply.status)
            except grpc.RpcError as e:
                statuses.append(e.code())
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert wait_until(lambda: statuses, timeout_s=5)
        stopper = threading.Thread(target=server.stop, args=(30,), daemon=True)
        with server.call_in_flight():
            stopper.start()
            assert wait_until(lambda: health_pb2.HealthCheckResponse.NOT_SERVING in statuses, timeout_s=5)
            stopper.join(1.0)
            assert stopper.is_alive()  # the call in flight keeps its grace
            released = time.monotonic()
        assert server.terminated.wait(5) and time.monotonic() - released < 2
        watcher.join(5)
    assert not watcher.is_alive()
    assert statuses[0] == health_pb2.HealthCheckResponse.SERVING and isinstance(statuses[-1], grpc.StatusCode)


def test_state_says_what_the_server_is_doing():
    server = WorkerServer(FakeRole())
    assert server.state() == "loading the model"
    with serving(server):
        assert server.state() == "serving, 0 calls in flight"
        with server.call_in_flight():
            assert server.state() == "serving, 1 call in flight" and not server.drained.is_set()
        assert server.drained.is_set()
    assert server.state() == "stopped, 0 calls in flight"


# ---- SignalStop, in process (no real signal: receive() is what the reading thread calls) --------------------------

@pytest.fixture
def exits(monkeypatch):
    """exit_now recorded instead of ending the test process, and faulthandler's watchdog (which would end it too)
    not armed: the seconds it would have been armed for are recorded as exit code None."""
    seen: list[tuple[int | None, str]] = []
    done = threading.Event()

    def record(code, message, *args, stacks=False):
        seen.append((code, message % args))
        done.set()
    monkeypatch.setattr(lifeline, "exit_now", record)
    monkeypatch.setattr(lifeline, "faulthandler", SimpleNamespace(
        dump_traceback_later=lambda timeout, **kwargs: seen.append((None, f"watchdog {timeout:g} s")),
        cancel_dump_traceback_later=lambda: None))
    made: list[SignalStop] = []

    def make(*args, **kwargs) -> SignalStop:
        made.append(SignalStop(*args, **kwargs))
        return made[-1]
    yield seen, done, make
    for signals in made:  # their deadline threads must not outlive the patched exit_now
        signals.uninstall()


def test_the_first_signal_stops_and_a_second_exits_at_once(exits, caplog):
    seen, _, make = exits
    stops = []
    signals = make(lambda: stops.append(1), grace_s=5, state=lambda: "serving, 2 calls in flight")
    with caplog.at_level(logging.INFO, logger="specmesh.worker.lifeline"):
        signals.receive(signal.SIGTERM)
        assert wait_until(lambda: stops == [1], timeout_s=5)
        assert seen == [(None, "watchdog 18 s")]  # armed (grace 5 + 10, and the backstop's 3), nothing else yet
        signals.receive(signal.SIGINT)
    assert seen[1][0] == 128 + signal.SIGINT and "received SIGINT" in seen[1][1]
    assert stops == [1]
    first = next(r.getMessage() for r in caplog.records if "received SIGTERM" in r.getMessage())
    assert "serving, 2 calls in flight; main thread in " in first and "ends within 15 s" in first


def test_a_stop_that_raises_is_logged_and_the_deadline_still_ends_the_process(exits, caplog):
    seen, done, make = exits

    def broken_stop():
        raise RuntimeError("injected: the stop failed")
    signals = make(broken_stop, grace_s=0, exit_margin_s=0.3)
    with caplog.at_level(logging.INFO, logger="specmesh.worker.lifeline"):
        signals.receive(signal.SIGTERM)
        assert done.wait(5)
    assert seen[-1][0] == 1 and "still running" in seen[-1][1] and "after SIGTERM" in seen[-1][1]
    assert any("the stop raised" in r.getMessage() for r in caplog.records)


def test_uninstall_cancels_the_deadline_and_other_signals_are_only_logged(exits, caplog):
    seen, done, make = exits
    signals = make(lambda: None, grace_s=0, exit_margin_s=0.3)
    with caplog.at_level(logging.INFO, logger="specmesh.worker.lifeline"):
        signals.receive(signal.SIGHUP)
        assert signals.received == []
        signals.receive(signal.SIGTERM)
        signals.uninstall()
        assert not done.wait(0.8)
    assert any("received SIGHUP" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)


# ---- Processes ----------------------------------------------------------------------------------------------------

# A native call that never returns and releases the GIL, as a forward pass in C that hangs would: a default pthread
# mutex locked twice by the same thread (the futex wait restarts after every signal).
NATIVE_HANG = """
import ctypes
def native_hang():
    lock = ctypes.CDLL(None).pthread_mutex_lock
    mutex = ctypes.create_string_buffer(64)
    lock(mutex)
    print("HANGING", flush=True)
    lock(mutex)
"""

# The verifier's batch runner (on the model thread: the main thread) hangs for a session whose id ends with "hang".
HANG_ON_SESSION = NATIVE_HANG + """
from verifier.engine import VerifyEngine
_run_batch = VerifyEngine._run_batch
def run_batch(self, batch):
    if any(r.session_id.endswith("/hang") for r in batch):
        native_hang()
    return _run_batch(self, batch)
VerifyEngine._run_batch = run_batch
"""

HEALTH_STEP_RAISES = """
from grpc_health.v1 import health
def refuse(self):
    raise RuntimeError("injected: enter_graceful_shutdown failed")
health.HealthServicer.enter_graceful_shutdown = refuse
"""

GRPC_STOP_RAISES = """
import grpc._server
def refuse(self, grace):
    raise RuntimeError("injected: grpc server stop failed")
grpc._server._Server.stop = refuse
"""


SLOW_LOAD = """
import time
from specmesh.worker.server import WorkerServer
_load = WorkerServer.load
def load(self):
    print("LOADING", flush=True)
    time.sleep(120)
    _load(self)
WorkerServer.load = load
"""

CALL_STARTED = """
from specmesh.worker.server import WorkerServicerBase
_before_work = WorkerServicerBase.before_work
def before_work(self, context):
    print("CALL STARTED", flush=True)
    _before_work(self, context)
WorkerServicerBase.before_work = before_work
"""


class Worker:
    """`verifier serve` (tiny float64 model) in a subprocess, with `inject` run first; its log in a file."""

    def __init__(self, log_dir: Path, *flags: str, inject: str = "", wait_for: str = "READY") -> None:
        self.log_path = log_dir / f"verifier-{time.monotonic_ns()}.log"
        code = f"import sys\n{inject}\nfrom verifier.cli import main\nsys.exit(main(sys.argv[1:]))\n"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, "serve", "--model", "tiny-random-qwen2", "--dtype", "float64",
                 "--device", "cpu", "--threads", "1", "--port", "0", "--log-format", "text", *flags],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert wait_until(lambda: any(line.startswith(f"{wait_for} ") for line in self.lines)
                          or self.process.poll() is not None, timeout_s=120), self.log()
        assert self.process.poll() is None, self.log()
        self.address = next(line.split()[1] for line in self.lines if line.startswith(f"{wait_for} "))

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.strip())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_line(self, line: str) -> None:
        """Until the worker has printed `line` on stdout (the injected code's markers)."""
        assert wait_until(lambda: line in self.lines, timeout_s=60), f"no {line!r}; its log:\n{self.log()}"

    def verify_in_background(self, session_id: str) -> list:
        """Start a Verify call on a thread; the list gets its reply or its error."""
        outcome: list = []

        def call() -> None:
            with grpc.insecure_channel(self.address) as channel:
                try:
                    outcome.append(pb_grpc.VerifierStub(channel).Verify(pb.VerifyRequest(
                        session_id=session_id, context=pb.ContextSync(base_length=0, base_hash=EMPTY_HASH,
                                                                      new_tokens=[1, 2, 3])), timeout=60))
                except grpc.RpcError as e:
                    outcome.append(e)
        threading.Thread(target=call, daemon=True).start()
        return outcome

    def signal_and_time(self, signum: int, bound_s: float) -> tuple[int, float]:
        """Send `signum`; (exit status, seconds to exit). Fails, after killing it, if it outlives `bound_s`."""
        started = time.monotonic()
        self.process.send_signal(signum)
        try:
            status = self.process.wait(bound_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {bound_s} s after {signal.Signals(signum).name}; its log:\n{self.log()}")
        return status, time.monotonic() - started

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(5)  # at end of file now
        self.process.stdout.close()


@pytest.fixture
def workers(tmp_path):
    started: list[Worker] = []

    def start(*flags: str, inject: str = "", wait_for: str = "READY") -> Worker:
        started.append(Worker(tmp_path, *flags, inject=inject, wait_for=wait_for))
        return started[-1]
    yield start
    for worker in started:
        worker.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_idle_worker_exits_on_the_signal_and_logs_it(workers, signum):
    worker = workers()
    wait_for_costs(worker.address, "verifier")  # idle: done measuring its costs, which it does once SERVING
    status, took = worker.signal_and_time(signum, bound_s=10)
    log = worker.log()
    assert status == 0, log
    assert f"received {signum.name} (serving, 0 calls in flight; main thread in serve_on_main_thread" in log, log
    assert "verifier stopped in" in log, log
    print(f"{signum.name}: exited in {took:.2f} s")


def test_signal_while_loading_abandons_the_load(workers):
    worker = workers(inject=SLOW_LOAD, wait_for="LISTENING")
    worker.wait_for_line("LOADING")  # then it sleeps for 120 s
    status, took = worker.signal_and_time(signal.SIGTERM, bound_s=10)
    log = worker.log()
    assert status == 0 and took < 5, log
    # The main thread gets to the signal at the same time as the signals thread describes the state: loading,
    # stopping or stopped, the main thread in the load or in the handler, all are right.
    assert "received SIGTERM (" in log, log
    assert "stopped while loading the model" in log, log


def test_signal_during_a_slow_call_lets_it_finish_and_exits(workers):
    """--inject-latency: the call waits 30 s before its work (cut short by the stop); the process exits long before."""
    worker = workers("--inject-latency", "30", "--grace", "2", inject=CALL_STARTED)
    outcome = worker.verify_in_background("slow")
    worker.wait_for_line("CALL STARTED")  # and waiting out its injected latency
    status, took = worker.signal_and_time(signal.SIGTERM, bound_s=10)
    log = worker.log()
    assert status == 0 and took < 8, log
    assert "received SIGTERM (serving, 1 call in flight" in log, log
    assert wait_until(lambda: outcome, timeout_s=5), "the in-flight call never ended"


def test_signal_while_the_model_thread_hangs_in_native_code_ends_at_the_deadline(workers):
    """The main thread never returns from a native call (GIL released): Python's own handler never runs there, yet
    the signal is logged at once, the server stops, and the process ends at grace + 10 s with every stack logged."""
    worker = workers("--grace", "0.5", inject=HANG_ON_SESSION)
    # Done measuring its costs first: a probe call caught behind the hung model thread would hold the stop up to its
    # 10 s limit, past the deadline, and "stopped in" would never be logged (seen once in CI).
    wait_for_costs(worker.address, "verifier")
    worker.verify_in_background("hang")
    worker.wait_for_line("HANGING")
    status, took = worker.signal_and_time(signal.SIGTERM, bound_s=25)
    log = worker.log()
    assert status == 1, log
    assert "received SIGTERM (serving, 1 call in flight; main thread in native_hang" in log, log
    assert "verifier stopped in" in log, log  # the gRPC side stopped although the call never ended
    assert "still running 10.5 s after SIGTERM" in log and "native_hang" in log.split("still running")[1], log
    assert 9 < took < 20, took


def test_a_second_signal_during_a_hung_stop_exits_at_once(workers):
    worker = workers("--grace", "30", inject=HANG_ON_SESSION)
    worker.verify_in_background("hang")
    worker.wait_for_line("HANGING")
    worker.process.send_signal(signal.SIGTERM)
    assert wait_until(lambda: "received SIGTERM" in worker.log(), timeout_s=10), worker.log()
    status, took = worker.signal_and_time(signal.SIGINT, bound_s=5)
    log = worker.log()
    assert status == 128 + signal.SIGINT, log
    assert "received SIGINT" in log and "after SIGTERM" in log and "exiting now" in log, log
    print(f"second signal: exited in {took:.2f} s")


@pytest.mark.parametrize("inject, expected", [(HEALTH_STEP_RAISES, "a step of stopping failed"),
                                              (GRPC_STOP_RAISES, "the stop raised")])
def test_a_stop_that_raises_still_ends_the_process(workers, inject, expected):
    worker = workers("--grace", "1", inject=inject)
    status, took = worker.signal_and_time(signal.SIGTERM, bound_s=15)
    log = worker.log()
    assert "received SIGTERM" in log and expected in log, log
    assert status in (0, 1), log  # 1: ended by the deadline
    print(f"{expected}: exit {status} in {took:.2f} s")


def test_signals_are_answered_while_the_main_thread_is_stuck_in_native_code():
    """SignalStop alone, in a bare process whose main thread blocks in native code from the start (no model)."""
    code = NATIVE_HANG + """
import logging, sys, threading
from specmesh.worker.lifeline import SignalStop
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
SignalStop(lambda: threading.Event().wait(), grace_s=1, state=lambda: "testing", exit_margin_s=1).install()
print("INSTALLED", flush=True)
native_hang()
"""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline().strip() == "INSTALLED"
        assert process.stdout.readline().strip() == "HANGING"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        status = process.wait(10)
        took = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    err = process.stderr.read()
    process.stdout.close()
    process.stderr.close()
    assert status == 1 and 1.5 < took < 6, (status, took, err)
    assert "received SIGTERM (testing; main thread in native_hang" in err, err
    assert "still running 2 s after SIGTERM" in err, err


def test_the_watchdog_ends_a_process_whose_python_threads_starve_after_the_signal():
    """A stop that enters native code which never returns and never releases the GIL (a builtin's C loop here)
    starves every Python thread, the deadline's included: faulthandler's watchdog, a C thread, still ends the
    process."""
    code = """
import logging, sys, threading
from specmesh.worker.lifeline import SignalStop
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
SignalStop(lambda: sum(range(10**15)), grace_s=0, exit_margin_s=1).install()  # C code, GIL held: hours
print("INSTALLED", flush=True)
threading.Event().wait()
"""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline().strip() == "INSTALLED"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            status = process.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail("still running 20 s after SIGTERM")
        took = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    err = process.stderr.read()
    process.stdout.close()
    process.stderr.close()
    assert status == 1 and 3 < took < 10, (status, took, err)
    assert "received SIGTERM" in err and "Timeout (0:00:04)!" in err and "in <lambda>" in err, err

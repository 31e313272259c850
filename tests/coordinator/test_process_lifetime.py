"""Processes end when they should: local workers die with their parent however it ends, Ctrl-C on `coordinator
generate` reports what was generated and exits 130, and malformed request bytes are answered INVALID_ARGUMENT by a
server that keeps serving (tiny float64 models)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import grpc
import pytest

from coordinator.fleet.local_workers import LocalWorker, LocalWorkerSpec
from coordinator.fleet.polling import wait_until
from drafter.service import run_server as run_drafter
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
from specmesh.wire.history import EMPTY_HASH
from tests.conftest import left_behind
from tests.coordinator.serving.test_http import processes_with
from verifier.service import run_server as run_verifier

TINY = ["--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2-b", "--dtype", "float64",
        "--device", "cpu", "--no-chat"]

PARENT = """
import sys, tempfile, threading, time
from coordinator.fleet.local_workers import LocalWorker, LocalWorkerSpec
log_dir = tempfile.mkdtemp()
verifier = LocalWorker(LocalWorkerSpec("verifier", "tiny-random-qwen2", "cpu", "float64", threads=1), log_dir)
# Started from a thread that ends at once: the worker must outlive the thread (a parent-death signal would not).
started = []
thread = threading.Thread(target=lambda: started.append(
    LocalWorker(LocalWorkerSpec("drafter", "tiny-random-qwen2-b", "cpu", "float64", threads=1), log_dir)))
thread.start()
thread.join()
for worker in (verifier, *started):
    worker.wait_serving()
print("PIDS", verifier.process.pid, started[0].process.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_local_workers_die_when_their_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(p) for p in line.split()[1:]]
        time.sleep(1.0)  # the drafter's starting thread ended a while ago
        assert all(alive(pid) for pid in pids)
    finally:
        parent.kill()  # SIGKILL: the parent runs no cleanup at all
        parent.wait()
        parent.stdout.close()
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout_s=15), \
        f"workers still running after their parent was killed: {[p for p in pids if alive(p)]}"


def test_left_behind_finds_orphans_by_their_mark():
    from tests.conftest import RUN_MARK
    mark = uuid.uuid4().hex
    # A child that starts a grandchild and exits: the grandchild is re-parented to PID 1 (or a subreaper).
    spawner = subprocess.run([sys.executable, "-c", "import subprocess; print(subprocess.Popen(['sleep', '60'],"
                              " start_new_session=True, stdout=subprocess.DEVNULL,"
                              " stderr=subprocess.DEVNULL).pid)"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, RUN_MARK: mark})
    orphan = int(spawner.stdout)
    try:
        assert orphan in left_behind(mark)
    finally:
        os.kill(orphan, signal.SIGKILL)
    assert wait_until(lambda: orphan not in left_behind(mark), timeout_s=5)


class Output:
    """A pipe read on a thread, so the test can wait for the first bytes without blocking."""

    def __init__(self, pipe) -> None:
        self.chunks: list[bytes] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        while chunk := os.read(pipe.fileno(), 4096):
            self.chunks.append(chunk)

    def text(self) -> str:
        self._thread.join(timeout=30)
        return b"".join(self.chunks).decode(errors="replace")


def default_sigint() -> None:
    """In the child before exec: SIGINT as a terminal's foreground command has it. A test run started in the background
    of a non-interactive shell (`make test &`) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
    handler: the Ctrl-C these tests send would be ignored, as nohup-style callers intend."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground process group


def assert_reported_interruption(process: subprocess.Popen, err: Output) -> str:
    assert process.wait(timeout=60) == 130
    stderr = err.text()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("\r")]
    assert lines[-1].startswith("coordinator: interrupted after "), stderr
    return lines[-1]


@pytest.fixture(scope="module")
def slow_workers(tmp_path_factory):
    """A verifier and a drafter that answer slowly, so that a generation is still running when it is interrupted."""
    log_dir = tmp_path_factory.mktemp("slow-workers")
    workers = [LocalWorker(LocalWorkerSpec(role, model, "cpu", "float64", threads=1,
                                           extra_args=("--inject-latency", "0.1")), str(log_dir))
               for role, model in (("verifier", "tiny-random-qwen2"), ("drafter", "tiny-random-qwen2-b"))]
    try:
        for worker in workers:
            worker.wait_serving()
        yield {w.spec.role: w.address for w in workers}
    finally:
        for worker in workers:
            worker.stop()


def test_ctrl_c_during_generate_prints_the_partial_text_and_exits_130(slow_workers):
    process = subprocess.Popen([sys.executable, "-m", "coordinator", "generate", "--prompt", "hello",
                                "--max-new-tokens", "500", "--verifier", slow_workers["verifier"],
                                "--drafter", slow_workers["drafter"], *TINY],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                               preexec_fn=default_sigint)
    out, err = Output(process.stdout), Output(process.stderr)
    assert wait_until(lambda: out.chunks or process.poll() is not None, timeout_s=120) and process.poll() is None
    interrupt(process)
    message = assert_reported_interruption(process, err)
    partial = out.text()
    assert partial and "new tokens in" not in partial  # the text so far, and no summary of a finished run
    assert message == f"coordinator: interrupted after {len(partial)} characters of output"


def test_ctrl_c_while_local_workers_load_stops_them_and_exits_130():
    mark = uuid.uuid4().hex
    process = subprocess.Popen([sys.executable, "-m", "coordinator", "generate", "--prompt", "hello", *TINY],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                               preexec_fn=default_sigint, env={**os.environ, "LIFETIME_TEST_MARK": mark})
    err = Output(process.stderr)
    # Interrupt once the verifier subprocess exists (its parent is waiting for it to load).
    assert wait_until(lambda: len(processes_with("LIFETIME_TEST_MARK", mark)) >= 2 or process.poll() is not None,
                      timeout_s=120)
    interrupt(process)
    assert_reported_interruption(process, err)
    process.stdout.close()
    assert wait_until(lambda: not processes_with("LIFETIME_TEST_MARK", mark), timeout_s=15), \
        "the local workers outlived the interrupted coordinator"


GARBAGE = [
    b"\xff\xff\xff\xff",  # field number 0 / a truncated varint
    b"\x12\xff\xff\xff\xff\x0f",  # field 2 (context) claims a 4 GB length
    b"\x0a\x02\xc3\x28",  # session_id (a string) that is not UTF-8
]


@pytest.mark.parametrize("service,method", [("Verifier", "Verify"), ("Drafter", "Propose"),
                                            ("grpc.health.v1.Health", "Check")])
def test_garbage_request_bytes_are_invalid_argument_and_the_server_keeps_serving(tiny_target, tiny_unrelated_draft,
                                                                                 service, method):
    run = run_verifier(tiny_target, port=0) if service != "Drafter" else run_drafter(tiny_unrelated_draft, port=0)
    with run as server, grpc.insecure_channel(server.address) as channel:
        path = f"/{service if '.' in service else 'specmesh.v1.' + service}/{method}"
        raw = channel.unary_unary(path)  # no serializer: the bytes go out as given
        for garbage in GARBAGE:
            with pytest.raises(grpc.RpcError) as error:
                raw(garbage, timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (garbage, error.value.details())
            assert "not a valid protobuf message" in error.value.details()
        # Still serving: a well-formed request on the same channel is answered.
        context = pb.ContextSync(base_length=0, base_hash=EMPTY_HASH, new_tokens=[1, 2, 3])
        if service == "Drafter":
            reply = pb_grpc.DrafterStub(channel).Propose(pb.ProposeRequest(session_id="ok", context=context,
                                                                           num_tokens=2), timeout=10)
            assert len(reply.tokens) == 2
        else:
            reply = pb_grpc.VerifierStub(channel).Verify(pb.VerifyRequest(session_id="ok", context=context),
                                                         timeout=10)
            assert reply.committed_length == 4  # the three tokens sent and the verifier's next one

"""Overload gets a fast, clear answer instead of an unbounded queue: HTTP 429 with Retry-After from `coordinator
serve` beyond --max-concurrent-requests + --max-queue, RESOURCE_EXHAUSTED from a worker beyond
--max-concurrent-rpcs."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import httpx
import openai
import pytest

from coordinator import Coordinator
from coordinator.serving.admission import AdmissionConfig
from coordinator.serving.http_api import create_app
from coordinator.fleet.polling import wait_until
from coordinator.fleet.worker_client import RemoteWorker
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.wire.history import EMPTY_HASH
from specmesh.wire.security import ClientSecurity
from tests.coordinator.serving.live_http import serving
from verifier.service import run_server as run_verifier

MODEL = "tiny-random-qwen2"
BODY = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def slow_coordinator(tiny_target):
    # 0.2 s per Verify, no drafter: a 12-token request runs for seconds, long enough to fill every slot.
    with run_verifier(tiny_target, port=0, inject_latency_s=0.2) as v:
        with Coordinator(v.address, tokenizer=tiny_target.tokenizer) as c:
            yield c


def test_requests_beyond_running_and_queued_get_429_with_retry_after(slow_coordinator):
    app = create_app(slow_coordinator, admission=AdmissionConfig(max_active=1, max_queue=1))
    admission = app.state.completions.admission
    with serving(app) as (url, _):
        replies: dict[str, httpx.Response] = {}

        def post(name: str) -> None:
            replies[name] = httpx.post(url + "/v1/completions", json=BODY, timeout=60)

        running = threading.Thread(target=post, args=("running",))
        running.start()
        assert wait_until(lambda: admission.active == 1, 10)
        queued = threading.Thread(target=post, args=("queued",))
        queued.start()
        assert wait_until(lambda: admission.waiting == 1, 10)
        refused = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
        # Answered at once: the first request is still running and the second still waiting.
        assert (admission.active, admission.waiting) == (1, 1)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.json()["error"]["code"] == "server_overloaded"
        health = httpx.get(url + "/health", timeout=10).json()
        assert (health["requests_running"], health["requests_waiting"]) == (1, 1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(**BODY)
        running.join(60)
        queued.join(60)
        assert replies["running"].status_code == replies["queued"].status_code == 200
        assert replies["queued"].json()["choices"][0]["text"] == replies["running"].json()["choices"][0]["text"]
        # Capacity is back: a new request runs.
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=60).status_code == 200
        assert (admission.active, admission.waiting) == (0, 0)


def test_max_queue_zero_refuses_whenever_every_slot_is_busy(slow_coordinator):
    app = create_app(slow_coordinator, admission=AdmissionConfig(max_active=1, max_queue=0))
    admission = app.state.completions.admission
    with serving(app) as (url, _):
        running = threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                                   kwargs={"json": BODY, "timeout": 60})
        running.start()
        assert wait_until(lambda: admission.active == 1, 10)
        streamed = httpx.post(url + "/v1/completions", json={**BODY, "stream": True}, timeout=60)
        assert streamed.status_code == 429 and "retry-after" in streamed.headers  # a status, not a broken stream
        running.join(60)


def test_admission_limits_are_validated():
    for bad, message in (({"max_active": 0}, "max_concurrent_requests"), ({"max_queue": -1}, "max_queue")):
        with pytest.raises(ValueError, match=message):
            AdmissionConfig(**bad)


def test_serve_flags_have_help_and_are_checked():
    help_text = subprocess.run([sys.executable, "-m", "coordinator", "serve", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    for flag in ("--max-concurrent-requests", "--max-queue", "--grace"):
        assert flag in help_text
    assert "(default: 64)" in help_text.split("--max-queue", 1)[1]
    refused = subprocess.run([sys.executable, "-m", "coordinator", "serve", "--max-concurrent-requests", "0"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "max_concurrent_requests must be >= 1" in refused.stderr


def test_a_worker_beyond_max_concurrent_rpcs_answers_resource_exhausted_at_once(tiny_target):
    """gRPC: calls beyond the limit are refused while the admitted ones are still running, never queued."""
    with run_verifier(tiny_target, port=0, max_concurrent_rpcs=2, inject_latency_s=3.0) as server:
        worker = RemoteWorker(server.address, "verifier", ClientSecurity())
        answers: list[tuple[float, grpc.StatusCode]] = []
        lock = threading.Lock()

        def call(i: int) -> None:
            try:
                worker.stub.Verify(pb.VerifyRequest(session_id=f"burst-{i}", context=pb.ContextSync(
                    base_length=0, base_hash=EMPTY_HASH, new_tokens=[1, 2, 3])), timeout=30)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            with lock:
                answers.append((time.monotonic(), code))
        try:
            threads = [threading.Thread(target=call, args=(i,)) for i in range(24)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            worker.close()
        codes = [code for _, code in answers]
        assert codes.count(grpc.StatusCode.OK) >= 2 and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 20
        first_ok = min(at for at, code in answers if code == grpc.StatusCode.OK)
        refusals = [at for at, code in answers if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert max(refusals) < first_ok  # every refusal came while the admitted calls were still running

"""A client that goes away cancels its generation; SIGTERM drains `coordinator serve`: running requests finish, new
ones get 503 with Retry-After, and stragglers are cancelled when the grace period ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from coordinator import Coordinator, GenerationOptions
from coordinator.cancel import CancelToken, GenerationCancelled
from coordinator.serving.http_api import create_app
from coordinator.fleet.polling import wait_until
from drafter.service import run_server as run_drafter
from tests.coordinator.serving.live_http import sample, serving
from verifier.service import run_server as run_verifier

MODEL = "tiny-random-qwen2"
PROMPT = "def add(a, b):"
LATENCY_S = 0.1  # per Propose and Verify: a long generation takes many seconds, so an uncancelled one is seen
LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0}


@pytest.fixture(scope="module")
def workers(tiny_target, tiny_unrelated_draft):
    with run_verifier(tiny_target, port=0, inject_latency_s=LATENCY_S) as v, \
            run_drafter(tiny_unrelated_draft, port=0, inject_latency_s=LATENCY_S) as d:
        yield v, d


@pytest.fixture(scope="module")
def coordinator(workers, tiny_target):
    verifier, drafter = workers
    with Coordinator(verifier.address, drafter.address, tokenizer=tiny_target.tokenizer) as c:
        yield c


def poll(condition, what: str, timeout_s: float = 15.0) -> None:
    if not wait_until(condition, timeout_s, interval_s=0.02):
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def sessions(worker) -> int:
    return len(worker.engine.sessions)


def forward_passes() -> tuple[float, float]:
    """Verifier forward passes and drafter proposals made in this process so far."""
    return sample("specmesh_verify_batch_size_count"), sample("specmesh_drafter_proposed_tokens_total")


def assert_cancelled_and_idle(api, workers, cancelled_before: float) -> None:
    verifier, drafter = workers
    # The generation thread ends soon after the disconnect (an uncancelled one would run for many seconds more).
    poll(lambda: api.admission.active == 0, "the generation to end after the client went away")
    assert sample("specmesh_generations_total", finish_reason="cancelled") == cancelled_before + 1
    assert sessions(verifier) == 0 and sessions(drafter) == 0  # EndSession reached both workers
    passes = forward_passes()
    time.sleep(5 * LATENCY_S)  # longer than a round: a generation still running would show up here
    assert forward_passes() == passes


def test_cancel_stops_the_call_in_flight_before_its_forward_pass(tiny_target):
    """The Python API's CancelToken: the call in flight (target-only: the Decode stream) is cancelled, and the worker
    drops it unrun."""
    with run_verifier(tiny_target, port=0, inject_latency_s=1.0) as verifier, \
            Coordinator(verifier.address, tokenizer=tiny_target.tokenizer) as c:
        dropped = sample("specmesh_rpc_requests_total", service="verifier", method="Decode", code="CANCELLED")
        passes = sample("specmesh_verify_batch_size_count")
        token = CancelToken()
        timer = threading.Timer(0.3, token.cancel)  # while the first Verify waits in the worker
        timer.start()
        with pytest.raises(GenerationCancelled) as cancelled:
            c.generate(c.encode_prompt(PROMPT, chat=False), GenerationOptions(max_new_tokens=8, draft_tokens=0),
                       cancel=token)
        timer.join()
        assert cancelled.value.partial.finish_reason == "cancelled" and cancelled.value.partial.token_ids == []
        poll(lambda: sample("specmesh_rpc_requests_total", service="verifier", method="Decode",
                            code="CANCELLED") == dropped + 1, "the worker to drop the cancelled call")
        assert sample("specmesh_verify_batch_size_count") == passes  # no forward pass ran for it
        assert sessions(verifier) == 0


def test_streaming_client_disconnect_cancels_the_generation(coordinator, workers):
    app = create_app(coordinator, draft_policy="heuristic")
    api = app.state.completions
    cancelled = sample("specmesh_generations_total", finish_reason="cancelled")
    with serving(app) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
                assert response.status_code == 200
                chunks = 0
                for line in response.iter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 3:
                        break
                assert sessions(workers[0]) == 1 and sessions(workers[1]) == 1
            # Leaving the block closes the connection mid-stream.
        assert_cancelled_and_idle(api, workers, cancelled)


def test_non_streaming_client_disconnect_cancels_the_generation(coordinator, workers):
    app = create_app(coordinator, draft_policy="heuristic")
    api = app.state.completions
    cancelled = sample("specmesh_generations_total", finish_reason="cancelled")
    with serving(app) as (url, _):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=1.0))
        assert_cancelled_and_idle(api, workers, cancelled)


def stream_text(url: str, body: dict, first_chunk: threading.Event, out: list) -> None:
    """Stream a completion, setting `first_chunk` when text starts to arrive; appends (text, error, done)."""
    text, error, done = "", None, False
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            payload = json.loads(line[len("data: "):])
            if "error" in payload:
                error = payload["error"]
            else:
                text += payload["choices"][0]["text"]
                first_chunk.set()
    out.append((text, error, done))


def test_sigterm_drains_running_requests_and_refuses_new_ones(coordinator, workers):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    want = coordinator.generate(coordinator.encode_prompt(PROMPT, chat=False), GenerationOptions(
        max_new_tokens=24, draft_policy="heuristic")).text
    app = create_app(coordinator, draft_policy="heuristic")
    with serving(app, grace_s=60) as (url, server):
        first_chunk, out = threading.Event(), []
        running = threading.Thread(target=stream_text, args=(url, body, first_chunk, out))
        running.start()
        assert first_chunk.wait(30)
        server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        refused = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "shutting_down"
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        running.join(60)
        assert out == [(want, None, True)]  # the running request finished, whole
        poll(lambda: server.should_exit, "the server to stop once drained")


def test_requests_still_running_after_the_grace_period_are_cancelled(coordinator, workers):
    app = create_app(coordinator, draft_policy="heuristic")
    with serving(app, grace_s=0.5) as (url, server):
        first_chunk, out = threading.Event(), []
        running = threading.Thread(target=stream_text, args=(url, LONG, first_chunk, out))
        running.start()
        assert first_chunk.wait(30)
        server.handle_exit(signal.SIGTERM, None)
        running.join(30)
        [(text, error, done)] = out
        assert text and error["code"] == "cancelled" and "shutting down" in error["message"] and done
        poll(lambda: server.should_exit, "the server to stop")
    assert sessions(workers[0]) == 0 and sessions(workers[1]) == 0


def test_coordinator_serve_drains_on_sigterm(workers, tiny_target):
    """The real command and signal: `coordinator serve` against running workers."""
    verifier, _ = workers
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    server = subprocess.Popen([sys.executable, "-m", "coordinator", "serve", "--port", "0", "--verifier",
                               verifier.address, "--draft-tokens", "0", "--grace", "60", "--log-level", "WARNING"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "SPECMESH_TOKEN": ""})
    try:
        line = server.stdout.readline()
        assert line.startswith("LISTENING http://"), (line, server.stderr.read() if server.poll() is not None else "")
        url = line.split()[1]
        first_chunk, out = threading.Event(), []
        running = threading.Thread(target=stream_text, args=(url, body, first_chunk, out))
        running.start()
        assert first_chunk.wait(60)
        server.send_signal(signal.SIGTERM)
        poll(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, "health to say draining")
        refused = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert refused.status_code == 503 and "retry-after" in refused.headers
        running.join(60)
        [(text, error, done)] = out
        assert error is None and done and text
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()
        server.stderr.close()

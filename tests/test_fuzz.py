"""Property-based fuzzing of live servers: random and malformed requests, and raw garbage on the socket; and of the
HTTP API in front of them. Every request gets OK or a proper error (never a 5xx), nothing crashes or hangs, and valid
requests afterwards still give exact output."""

from __future__ import annotations

import json
import socket
import threading

import grpc
import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import Coordinator, GenerationOptions
from coordinator.http_api import create_app
from coordinator.worker_client import RemoteWorker
from drafter.service import run_server as run_drafter
from tests.fuzz_strategies import (END, HTTP_BODY_LIMIT, HTTP_MODEL, HTTP_REQUEST, PROPER, PROPOSE, VERIFY, call,
                                   http_call, send_garbage)
from tests.helpers import reference_greedy
from verifier.service import run_server as run_verifier

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def servers(tiny_target, tiny_unrelated_draft):
    with run_verifier(tiny_target, port=0, max_draft_tokens=16) as v, run_drafter(tiny_unrelated_draft, port=0) as d:
        verifier, drafter = RemoteWorker(v.address, "verifier"), RemoteWorker(d.address, "drafter")
        yield v, d, verifier, drafter
        verifier.close()
        drafter.close()


@FUZZ
@given(request=VERIFY)
def test_fuzzed_verify(servers, request):
    code = call(servers[2].stub.Verify, request)
    assert code in PROPER, f"{code} for {request}"


@FUZZ
@given(request=PROPOSE)
def test_fuzzed_propose(servers, request):
    code = call(servers[3].stub.Propose, request)
    assert code in PROPER, f"{code} for {request}"


@settings(max_examples=40, deadline=None)
@given(request=END)
def test_fuzzed_end_session(servers, request):
    assert call(servers[2].stub.EndSession, request) in PROPER


@settings(max_examples=40, deadline=None)
@given(garbage=st.binary(max_size=2048))
def test_garbage_bytes_as_a_request_body(servers, garbage):
    raw = servers[2].channel.unary_unary("/specmesh.v1.Verifier/Verify")  # bytes in, bytes out: no parsing
    try:
        raw(garbage, timeout=10)
    except grpc.RpcError as e:
        assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED


@settings(max_examples=30, deadline=None)
@given(garbage=st.binary(min_size=1, max_size=4096))
def test_garbage_bytes_on_the_socket(servers, garbage):
    send_garbage(servers[0].port, garbage, reply_timeout_s=2)
    assert servers[2].is_serving()


def test_valid_requests_are_exact_after_fuzzing(servers, tiny_target):
    test_fuzzed_verify(servers)  # run the fuzzers first (also when this test runs alone)
    test_fuzzed_propose(servers)
    test_garbage_bytes_on_the_socket(servers)
    prompt = tiny_target.tokenizer("while True:")["input_ids"]
    expected = reference_greedy(tiny_target.model, prompt, 24, set(tiny_target.eos_token_ids))
    with Coordinator(servers[0].address, servers[1].address, tokenizer=tiny_target.tokenizer) as c:
        assert c.generate(list(prompt), GenerationOptions(max_new_tokens=24)).token_ids == expected


@pytest.fixture(scope="module")
def http_coordinator(servers, tiny_target):
    with Coordinator(servers[0].address, servers[1].address, tokenizer=tiny_target.tokenizer) as coordinator:
        yield coordinator


@pytest.fixture(scope="module")
def http(http_coordinator):
    """The HTTP API in front of the fuzzed servers (in-process uvicorn on a loopback port), and an httpx client."""
    listener = socket.create_server(("127.0.0.1", 0))
    app = create_app(http_coordinator, default_max_tokens=4)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.02)
    with httpx.Client(base_url=f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=30) as client:
        yield client
    server.should_exit = True
    thread.join(10)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=HTTP_REQUEST)
def test_fuzzed_http_requests_never_get_a_server_error(http, request):
    status, failed = http_call(http, *request)
    assert not failed, f"{status} for {request!r:.500}"


@pytest.mark.parametrize("body, status, field", [
    # Found by the fuzzer: each was a 500 (a lone surrogate reached the tokenizer; top_k overflowed the int32 wire
    # field) or had no limit (uvicorn reads a body of any size).
    ('{"model": "%s", "prompt": "\\ud800", "max_tokens": 2}' % HTTP_MODEL, 400, "prompt"),
    ('{"model": "%s", "messages": [{"role": "user", "content": "a\\udfff"}]}' % HTTP_MODEL, 400,
     "messages.0.content"),
    (json.dumps({"model": HTTP_MODEL, "prompt": "a", "top_k": 2**40, "temperature": 1}), 400, "top_k"),
    (json.dumps({"model": HTTP_MODEL, "prompt": "a" * HTTP_BODY_LIMIT}), 413, None),
])
def test_bad_input_found_by_fuzzing_is_a_client_error(http, body, status, field):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == field


def test_an_oversized_chunked_body_is_refused_while_it_streams(http):
    def chunks():  # no Content-Length: the limit must count what arrives
        for _ in range(HTTP_BODY_LIMIT // 65536 + 2):
            yield b"a" * 65536
    response = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_http_generation_is_exact_after_fuzzing(http, http_coordinator, tiny_target):
    test_fuzzed_http_requests_never_get_a_server_error(http)
    prompt = "while True:"
    ids = tiny_target.tokenizer(prompt)["input_ids"]
    want = http_coordinator.generate(list(ids), GenerationOptions(max_new_tokens=12))
    assert want.token_ids == reference_greedy(tiny_target.model, ids, 12, set(tiny_target.eos_token_ids))
    reply = http.post("/v1/completions", json={"model": HTTP_MODEL, "prompt": prompt, "max_tokens": 12,
                                               "temperature": 0})
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["text"] == want.text
    assert reply.json()["usage"]["completion_tokens"] == len(want.token_ids)

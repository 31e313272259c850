"""Property-based fuzzing of live servers: random and malformed requests, and raw garbage on the socket. Every
request gets OK or a proper error, nothing crashes or hangs, and valid requests afterwards still give exact output."""

from __future__ import annotations


import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import Coordinator, GenerationOptions
from coordinator.worker_client import RemoteWorker
from drafter.service import run_server as run_drafter
from tests.fuzz_strategies import END, PROPER, PROPOSE, VERIFY, call, send_garbage
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

"""TLS, mutual TLS, bearer tokens, limits and session isolation against live servers (tiny float64 models)."""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import pytest

from coordinator import Coordinator, GenerationOptions
from coordinator.fleet.worker_client import RemoteWorker
from specmesh.wire.history import EMPTY_HASH
from specmesh.wire.security import ClientSecurity, TlsFiles, exposure_warning
from specmesh.worker.session_store import SessionLimits
from specmesh.v1 import specmesh_pb2 as pb
from tests.certs import ThrowawayPKI
from tests.helpers import reference_greedy
from verifier.service import run_server as run_verifier

TOKEN = "correct-horse-battery-staple-0123"
MAX_NEW = 24


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    pki = ThrowawayPKI(tmp_path_factory.mktemp("pki"))
    pki.server = pki.issue("server", server=True)
    pki.client = pki.issue("client-a", server=False)
    return pki


@pytest.fixture(scope="module")
def prompt(tiny_target):
    return tiny_target.tokenizer("import os\n")["input_ids"]


@pytest.fixture(scope="module")
def expected(tiny_target, prompt):
    return reference_greedy(tiny_target.model, prompt, MAX_NEW, set(tiny_target.eos_token_ids))


def call_verify(address: str, security: ClientSecurity) -> pb.VerifyResponse:
    worker = RemoteWorker(address, "verifier", security)
    try:
        return worker.stub.Verify(pb.VerifyRequest(session_id="probe", context=pb.ContextSync(
            base_length=0, base_hash=EMPTY_HASH, new_tokens=[1, 2, 3])), timeout=5)
    finally:
        worker.close()


def status_of(address: str, security: ClientSecurity) -> grpc.StatusCode:
    try:
        call_verify(address, security)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


@pytest.fixture(scope="module")
def tls_token_verifier(tiny_target, pki):
    cert, key = pki.server
    with run_verifier(tiny_target, port=0, tls=TlsFiles(cert=cert, key=key), token=TOKEN) as server:
        yield server


def test_tls_and_token_are_enforced(tls_token_verifier, pki, tiny_target, prompt, expected):
    address = tls_token_verifier.address
    assert status_of(address, ClientSecurity(token=TOKEN)) == grpc.StatusCode.UNAVAILABLE  # plaintext to TLS
    tls = TlsFiles(ca=pki.ca_path)
    assert status_of(address, ClientSecurity(tls=tls)) == grpc.StatusCode.UNAUTHENTICATED  # no token
    assert status_of(address, ClientSecurity(tls=tls, token="x" * 32)) == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(address, ClientSecurity(tls=tls, token=TOKEN)) == grpc.StatusCode.OK
    with Coordinator(address, tokenizer=tiny_target.tokenizer, security=ClientSecurity(tls=tls, token=TOKEN)) as c:
        assert c.generate(list(prompt), GenerationOptions(max_new_tokens=MAX_NEW)).token_ids == expected


def test_a_certificate_from_another_ca_is_refused(tls_token_verifier, tmp_path):
    other = ThrowawayPKI(tmp_path, "some other CA")
    assert status_of(tls_token_verifier.address,
                     ClientSecurity(tls=TlsFiles(ca=other.ca_path), token=TOKEN)) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate(tiny_target, pki, prompt, expected):
    cert, key = pki.server
    with run_verifier(tiny_target, port=0, tls=TlsFiles(cert=cert, key=key, ca=pki.ca_path)) as server:
        assert status_of(server.address, ClientSecurity(tls=TlsFiles(ca=pki.ca_path))) == grpc.StatusCode.UNAVAILABLE
        client_cert, client_key = pki.client
        mtls = ClientSecurity(tls=TlsFiles(ca=pki.ca_path, cert=client_cert, key=client_key))
        assert status_of(server.address, mtls) == grpc.StatusCode.OK
        with Coordinator(server.address, tokenizer=tiny_target.tokenizer, security=mtls) as c:
            assert c.generate(list(prompt), GenerationOptions(max_new_tokens=MAX_NEW)).token_ids == expected


def test_token_without_tls_and_health_stays_open(tiny_target):
    with run_verifier(tiny_target, port=0, token=TOKEN) as server:
        assert status_of(server.address, ClientSecurity()) == grpc.StatusCode.UNAUTHENTICATED
        assert status_of(server.address, ClientSecurity(token=TOKEN)) == grpc.StatusCode.OK
        worker = RemoteWorker(server.address, "verifier", ClientSecurity())
        try:
            assert worker.is_serving()  # probes (Kubernetes, load balancers) carry no credentials
        finally:
            worker.close()


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", None, None) is None
    assert exposure_warning("localhost", None, None) is None
    assert "without TLS and a token" in exposure_warning("0.0.0.0", None, None)
    run = subprocess.Popen([sys.executable, "-m", "verifier", "serve", "--model", "tiny-random-qwen2",
                            "--host", "0.0.0.0", "--port", "0", "--device", "cpu"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline().startswith("LISTENING")
    finally:
        run.terminate()
        _, err = run.communicate(timeout=30)
    assert "WARNING: listening on 0.0.0.0 without TLS and a token" in err


def test_concurrent_rpc_limit_answers_resource_exhausted(tiny_target):
    with run_verifier(tiny_target, port=0, max_concurrent_rpcs=1, inject_latency_s=1.0) as server:
        codes = []

        def call() -> None:
            codes.append(status_of(server.address, ClientSecurity()))
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
        assert status_of(server.address, ClientSecurity()) == grpc.StatusCode.OK  # still serving


def test_message_size_and_context_limits(tiny_target):
    with run_verifier(tiny_target, port=0, max_message_bytes=4096, max_context_length=64) as server:
        worker = RemoteWorker(server.address, "verifier", ClientSecurity())
        try:
            for tokens, code in (([1] * 5000, grpc.StatusCode.RESOURCE_EXHAUSTED),
                                 ([1] * 100, grpc.StatusCode.INVALID_ARGUMENT)):
                with pytest.raises(grpc.RpcError) as error:
                    worker.stub.Verify(pb.VerifyRequest(session_id="big", context=pb.ContextSync(
                        base_length=0, base_hash=EMPTY_HASH, new_tokens=tokens)), timeout=5)
                assert error.value.code() == code
        finally:
            worker.close()
        assert status_of(server.address, ClientSecurity()) == grpc.StatusCode.OK


def test_kv_cache_memory_limit_evicts_and_output_stays_exact(tiny_target, prompt, expected):
    limit = 64 * 1024  # the tiny float64 model keeps 1 KiB of keys/values per token: about 64 tokens
    with run_verifier(tiny_target, port=0, limits=SessionLimits(max_cache_bytes=limit)) as server:
        worker = RemoteWorker(server.address, "verifier", ClientSecurity())
        store = server.engine.sessions
        try:
            for session_id in ("a", "b", "c"):  # 40 tokens each: two sessions together exceed the limit
                worker.stub.Verify(pb.VerifyRequest(session_id=session_id, context=pb.ContextSync(
                    base_length=0, base_hash=EMPTY_HASH, new_tokens=list(range(1, 41)))), timeout=5)
                assert len(store) == 1 and 0 < store.cache_bytes <= limit
        finally:
            worker.close()
        with Coordinator(server.address, tokenizer=tiny_target.tokenizer) as c:
            assert c.generate(list(prompt), GenerationOptions(max_new_tokens=MAX_NEW)).token_ids == expected


def test_another_client_naming_my_session_cannot_change_my_tokens(tiny_target, prompt, expected):
    """Even an attacker who learns a session id (they are 122-bit random) only forces a resync: the victim's
    history is checked by hash on every call, so the tokens it receives stay exactly right."""
    with run_verifier(tiny_target, port=0) as server:
        attacker = RemoteWorker(server.address, "verifier", ClientSecurity())
        attacks = []

        with Coordinator(server.address, tokenizer=tiny_target.tokenizer) as c:
            def interfere(text: str) -> None:
                session_id = _victim_session(server)
                for tokens in ([7, 7, 7], list(prompt) + [1, 2, 3]):
                    attacker.stub.Verify(pb.VerifyRequest(session_id=session_id, context=pb.ContextSync(
                        base_length=0, base_hash=EMPTY_HASH, new_tokens=tokens), draft_tokens=[5, 6]), timeout=5)
                    attacks.append(session_id)
            result = c.generate(list(prompt), GenerationOptions(max_new_tokens=MAX_NEW, draft_tokens=0),
                                on_text=interfere)
        attacker.close()
    assert len(attacks) >= 4
    assert result.token_ids == expected
    assert result.stats["resyncs"] >= 1


def _victim_session(server) -> str:
    # The test plays an attacker who somehow learned the id: read it from the server's own store.
    keys = [k for k in server.engine.sessions._sessions.keys() if not k.endswith("/warm-up")]
    return keys[0].split("/", 1)[1]


def test_health_checks_are_exempt_from_the_concurrency_limit(tiny_target):
    with run_verifier(tiny_target, port=0, max_concurrent_rpcs=1, inject_latency_s=1.5) as server:
        busy = threading.Thread(target=status_of, args=(server.address, ClientSecurity()))
        busy.start()
        worker = RemoteWorker(server.address, "verifier", ClientSecurity())
        try:
            import time
            deadline = time.monotonic() + 5
            while server.engine is not None and time.monotonic() < deadline:
                if status_of(server.address, ClientSecurity()) == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    break  # the slot is taken
            assert worker.is_serving()  # yet the probe still answers SERVING
        finally:
            worker.close()
            busy.join()

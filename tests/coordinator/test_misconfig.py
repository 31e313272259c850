"""Misconfiguration fails fast and names its cause: plaintext to a TLS worker, TLS without the client certificate a
mutual-TLS worker requires, TLS to a plaintext worker, an untrusted certificate, nothing listening; while a worker that
answers but is still loading is waited for (tiny float64 models, certificates from tests/certs.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator import Coordinator
from coordinator.fleet.local_workers import free_port
from coordinator.fleet.worker_client import WorkerError
from specmesh.wire.security import ClientSecurity, TlsFiles
from tests.certs import ThrowawayPKI
from verifier.service import run_server as run_verifier

PATIENCE_S = 120.0  # the connect timeout in these tests: failing fast means failing long before it


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    pki = ThrowawayPKI(tmp_path_factory.mktemp("pki"))
    pki.server = pki.issue("server", server=True)
    pki.client = pki.issue("client", server=False)
    return pki


@pytest.fixture(scope="module")
def tls_verifier(tiny_target, pki):
    cert, key = pki.server
    with run_verifier(tiny_target, port=0, tls=TlsFiles(cert=cert, key=key)) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_verifier(tiny_target, pki):
    cert, key = pki.server
    with run_verifier(tiny_target, port=0, tls=TlsFiles(cert=cert, key=key, ca=pki.ca_path)) as server:
        yield server


@pytest.fixture(scope="module")
def plain_verifier(tiny_target):
    with run_verifier(tiny_target, port=0) as server:
        yield server


def connect_error(address: str, security: ClientSecurity, tiny_target, **options) -> tuple[str, float]:
    """The WorkerError a Coordinator raises at start, and how long it took."""
    started = time.monotonic()
    with pytest.raises(WorkerError) as error:
        Coordinator(address, tokenizer=tiny_target.tokenizer, security=security,
                    connect_timeout_s=options.pop("connect_timeout_s", PATIENCE_S), **options)
    return str(error.value), time.monotonic() - started


def test_plaintext_to_a_tls_worker_names_tls(tls_verifier, tiny_target):
    message, took = connect_error(tls_verifier.address, ClientSecurity(), tiny_target)
    assert "speaks TLS and this client plaintext" in message and tls_verifier.address in message
    assert took < PATIENCE_S / 2


def test_tls_without_a_client_certificate_names_mutual_tls(mtls_verifier, pki, tiny_target):
    message, took = connect_error(mtls_verifier.address, ClientSecurity(tls=TlsFiles(ca=pki.ca_path)), tiny_target)
    assert "client certificate required" in message
    assert took < PATIENCE_S / 2


def test_plaintext_to_a_mutual_tls_worker_names_tls(mtls_verifier, tiny_target):
    message, _ = connect_error(mtls_verifier.address, ClientSecurity(), tiny_target)
    assert "speaks TLS and this client plaintext" in message and "requires a client certificate" in message


def test_tls_to_a_plaintext_worker_names_plaintext(plain_verifier, pki, tiny_target):
    message, took = connect_error(plain_verifier.address, ClientSecurity(tls=TlsFiles(ca=pki.ca_path)), tiny_target)
    assert "TLS handshake refused: the worker speaks plaintext" in message
    assert took < PATIENCE_S / 2


def test_a_certificate_from_another_ca_names_the_ca(tls_verifier, tiny_target, tmp_path):
    other = ThrowawayPKI(tmp_path, "some other CA")
    message, _ = connect_error(tls_verifier.address, ClientSecurity(tls=TlsFiles(ca=other.ca_path)), tiny_target)
    assert "not signed by the CA given with --tls-ca" in message


def test_nothing_listening_is_connection_refused_after_the_unreachable_timeout(tiny_target):
    address = f"127.0.0.1:{free_port()}"
    message, took = connect_error(address, ClientSecurity(), tiny_target, unreachable_timeout_s=1.0)
    assert f"verifier at {address}: connection refused" in message
    assert took < PATIENCE_S / 2
    # Without an unreachable timeout a refused connection is waited for like a loading worker, and the timeout's
    # message still says what failed.
    message, _ = connect_error(address, ClientSecurity(), tiny_target, connect_timeout_s=3.0)
    assert "no verifier SERVING within 3 s" in message and "Connection refused" in message


def test_a_worker_that_is_still_loading_is_waited_for():
    # What a loading worker looks like from outside: its port answers, health says NOT_SERVING.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(WorkerError) as error:
            Coordinator(f"127.0.0.1:{port}", tokenizer=object(), connect_timeout_s=4.0, unreachable_timeout_s=0.5)
        assert "no verifier SERVING within 4 s" in str(error.value)
        assert "last error" not in str(error.value)  # nothing failed: it is just not ready
    finally:
        server.stop(0)


def test_generate_cli_reports_a_tls_mismatch_in_one_line_and_exits_2(tls_verifier):
    """A misconfiguration the user can fix: one line naming it and the fix, status 2 (as every user error:
    tests/coordinator/test_cli_errors.py)."""
    run = subprocess.run([sys.executable, "-m", "coordinator", "generate", "--prompt", "x", "--draft-tokens", "0",
                          "--verifier", tls_verifier.address, "--connect-timeout", str(PATIENCE_S)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.startswith(f"coordinator: error: verifier at {tls_verifier.address}: TLS handshake refused: "
                                 "the worker speaks TLS and this client plaintext (pass --tls-ca)"), run.stderr
    assert len(run.stderr.splitlines()) == 1 and "Traceback" not in run.stderr

"""Why a worker cannot be reached, in words that name the fix.

gRPC reports a failed connection as UNAVAILABLE with a details string that usually names the cause ("Connection
refused", "Tls handshake failed ... WRONG_VERSION_NUMBER", "CERTIFICATE_VERIFY_FAILED", "Domain name not found").
Two misconfigurations only say "Socket closed": a plaintext client talking to a TLS worker, and a TLS client without
the client certificate a mutual-TLS worker requires (TLS 1.3 finishes the client's side of the handshake before the
server checks the certificate). For those a short TLS handshake of our own (Python's ssl module) tells which it is.

A cause is `misconfigured` when waiting cannot fix it (TLS settings that do not match); refused connections and
unknown host names are not (the worker may be starting), so the coordinator waits a little longer for those.

`start_failure` turns what stopped `coordinator generate` or `coordinator serve` from using its workers at start into
the line it prints and its exit status: 2, one line naming the cause and the fix, for what the user can fix (an
address nothing listens at, a name that does not resolve, TLS settings or a bearer token that do not match the
worker's, a drafter whose tokenizer cannot be paired with the verifier's, a local worker that refused its flags); 1,
with whatever the error says (a worker's log tail), for the rest (a worker that crashed or never became ready).
"""

from __future__ import annotations

import re
import socket
import ssl
from dataclasses import dataclass

from specmesh.ops.preflight import one_line
from specmesh.wire.security import TOKEN_ENV, TOKEN_FILE_ENV, ClientSecurity


@dataclass(frozen=True)
class ConnectFailure:
    cause: str  # one line, saying what to change
    misconfigured: bool  # waiting will not help


def diagnose(address: str, details: str, security: ClientSecurity, probe_timeout_s: float = 2.0
             ) -> ConnectFailure | None:
    """The cause of a failed connection to `address` from gRPC's error details; None when they name no known
    cause (a timeout, say: the worker may be slow or the network lossy)."""
    tls = security.tls is not None and security.tls.enabled
    has_client_cert = tls and bool(security.tls.cert)
    if "Connection refused" in details:
        return ConnectFailure("connection refused: nothing listens at that address (wrong host or port, or the "
                              "worker is not running)", misconfigured=False)
    if "Domain name not found" in details or "errors resolving" in details:
        return ConnectFailure("the host name does not resolve (check the host in --verifier or --drafter)",
                              misconfigured=False)
    if "WRONG_VERSION_NUMBER" in details and tls:
        return ConnectFailure("TLS handshake refused: the worker speaks plaintext (start it with --tls-cert and "
                              "--tls-key, or connect without --tls-ca)", misconfigured=True)
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return ConnectFailure("TLS handshake failed: the worker's certificate is not signed by the CA given with "
                              "--tls-ca, or does not name this host (--tls-server-name)", misconfigured=True)
    if "handshake failed" in details.lower():
        return ConnectFailure(f"TLS handshake failed: {details.rsplit(': ', 1)[-1]}", misconfigured=True)
    if "Socket closed" in details or "Connection reset" in details:
        answer = tls_probe(address, security, probe_timeout_s)
        if answer in ("tls", "certificate required") and not tls:
            also = (", and --tls-cert/--tls-key: it requires a client certificate" if answer == "certificate required"
                    else "")
            return ConnectFailure(f"TLS handshake refused: the worker speaks TLS and this client plaintext (pass "
                                  f"--tls-ca{also})", misconfigured=True)
        if answer == "certificate required" and not has_client_cert:
            return ConnectFailure("client certificate required: the worker uses mutual TLS (pass --tls-cert and "
                                  "--tls-key with a certificate signed by a CA the worker's --tls-ca trusts)",
                                  misconfigured=True)
        if answer == "certificate required":
            return ConnectFailure("client certificate refused: the worker does not trust the certificate given with "
                                  "--tls-cert (signed by a CA outside the worker's --tls-ca?)", misconfigured=True)
    return None


def tls_probe(address: str, security: ClientSecurity, timeout_s: float) -> str:
    """"tls" when `address` completes a TLS handshake (certificates unchecked: this asks only what the worker
    speaks), "certificate required" when it then refuses us for our client certificate (none, or an untrusted
    one), "no tls" when it does not speak TLS, "unknown" when it cannot be asked."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        return "unknown"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    tls = security.tls
    try:
        if tls is not None and tls.cert:
            context.load_cert_chain(tls.cert, tls.key)
        with socket.create_connection((host, int(port)), timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=host) as connection:
            try:
                # A gRPC server sends its HTTP/2 settings at once. One that refuses our certificate (or its absence)
                # closes the connection instead, with or without an alert: TLS 1.3 lets the client finish its side
                # of the handshake before the server has checked the client's certificate.
                return "tls" if connection.recv(1) else "certificate required"
            except TimeoutError:
                return "tls"
    except ssl.SSLError as e:
        text = f"{e.reason} {e}".upper()
        if "CERTIFICATE_REQUIRED" in text or "BAD_CERTIFICATE" in text or "UNKNOWN_CA" in text or \
                "HANDSHAKE_FAILURE" in text:
            return "certificate required"
        return "no tls"
    except OSError:
        return "unknown"


# The causes diagnose() names: a WorkerError that carries one is a misconfiguration the user can fix.
USER_CAUSES = ("connection refused:", "the host name does not resolve", "TLS handshake", "client certificate")
TOKEN_FIX = f"${TOKEN_ENV} (or --token-file, ${TOKEN_FILE_ENV}) must hold the worker's token"
TOKEN_REFUSED = {
    "this server requires a bearer token": f"the worker requires a bearer token and this client sent none: {TOKEN_FIX}",
    "missing or wrong bearer token": f"the worker refused this client's bearer token: {TOKEN_FIX}",
}


def start_failure(error: Exception, user_error: bool = False) -> tuple[str, int]:
    """(the message, the exit status) for an error that kept the coordinator from using its workers at start;
    `user_error`: the caller knows it is one the user can fix (coordinator.api.TokenizerMismatch)."""
    text = str(error)
    if user_error:
        return one_line(text), 2
    refused = re.fullmatch(r"(.+?): Info failed: UNAUTHENTICATED (.*)", text, re.DOTALL)
    if refused and refused.group(2).strip() in TOKEN_REFUSED:
        return f"{refused.group(1)}: {TOKEN_REFUSED[refused.group(2).strip()]}", 2
    if "\n" not in text and any(f": {cause}" in text for cause in USER_CAUSES):
        return text, 2
    # A local worker that refused its flags ended with its own one-line error (specmesh/worker/cli.py).
    lines = [line for line in text.splitlines() if line.strip()]
    own = re.fullmatch(r"(drafter|verifier): error: (.*)", lines[-1].strip()) if lines else None
    if own and ("did not start" in lines[0] or "before it was ready" in lines[0]):
        return f"local {own.group(1)}: {own.group(2)}", 2
    return text, 1

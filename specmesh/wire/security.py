"""Transport security and authentication: TLS / mutual TLS credentials, bearer tokens, the exposure warning.

A verifier fleet is an expensive, network-reachable service: with a token configured, every RPC except health
checks (which load balancers and Kubernetes probes send without credentials) must carry `authorization: Bearer
<token>`, compared in constant time. Sessions are namespaced by the caller's identity (a hash of its token, or its
client certificate's subject), so one client cannot even name another client's session.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import ipaddress
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from specmesh.wire.printable import printable

TOKEN_ENV = "SPECMESH_TOKEN"
TOKEN_FILE_ENV = "SPECMESH_TOKEN_FILE"
_UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/",)

# The authenticated caller of the current RPC, set by TokenAuthInterceptor for the servicer.
caller_identity: contextvars.ContextVar[str] = contextvars.ContextVar("specmesh_caller_identity", default="")


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what} '{printable(path)}': {e.strerror}") from None


@dataclass(frozen=True)
class TlsFiles:
    """PEM files. A server needs cert + key (+ ca to require client certificates: mutual TLS); a client needs ca to
    verify the server (+ cert + key to present its own certificate)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None  # client only: override the name checked in the server's certificate

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a TLS certificate and its private key must be given together")
        for what, path in (("certificate", self.cert), ("private key", self.key), ("CA bundle", self.ca)):
            _read(path, what)

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert and self.key):
            raise ValueError("a TLS server needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials([(_read(self.key, "private key"), _read(self.cert, "certificate"))],
                                           root_certificates=_read(self.ca, "CA bundle"),
                                           require_client_auth=bool(self.ca))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "CA bundle"),
                                            private_key=_read(self.key, "private key"),
                                            certificate_chain=_read(self.cert, "certificate"))


def load_token(token_file: str | None = None) -> str | None:
    """The bearer token from a file (--token-file or $SPECMESH_TOKEN_FILE) or $SPECMESH_TOKEN; None when unset."""
    path = token_file or os.environ.get(TOKEN_FILE_ENV)
    if path:
        token = (_read(path, "token file") or b"").decode().strip()
        if not token:
            raise ValueError(f"token file '{printable(path)}' is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def token_identity(token: str) -> str:
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]


def _deny(message: str) -> grpc.RpcMethodHandler:
    def abort(request, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    return grpc.unary_unary_rpc_method_handler(abort)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._identity = token_identity(token)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(_UNAUTHENTICATED_METHODS):
            return continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if not hmac.compare_digest(presented.encode(), self._expected):
            return _deny("missing or wrong bearer token" if presented else "this server requires a bearer token")
        caller_identity.set(self._identity)
        return continuation(handler_call_details)


class ConcurrencyLimitInterceptor(grpc.ServerInterceptor):
    """At most `limit` model calls in progress; more are answered RESOURCE_EXHAUSTED at once. Health checks are
    exempt, so a busy worker is not mistaken for a dead one by its probes."""

    def __init__(self, limit: int) -> None:
        self._slots = threading.BoundedSemaphore(limit)
        self._limit = limit

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or \
                handler_call_details.method.startswith(_UNAUTHENTICATED_METHODS):
            return handler
        slots, limit = self._slots, self._limit

        def take_slot(context) -> None:
            if not slots.acquire(blocking=False):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {limit} calls in progress")

        def limited(request, context):
            take_slot(context)
            try:
                return handler.unary_unary(request, context)
            finally:
                slots.release()

        def limited_stream(request, context):  # a response stream (Decode) holds its slot until it ends
            take_slot(context)
            try:
                yield from handler.unary_stream(request, context)
            finally:
                slots.release()
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(limited_stream,
                                                        request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(limited, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the bearer token to every call (works on plaintext channels too, unlike call credentials)."""

    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        metadata = [*(details.metadata or ()), self._metadata]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base, metadata) -> None:
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready, self.compression = base.wait_for_ready, base.compression
        self.metadata = metadata


@dataclass(frozen=True)
class ClientSecurity:
    """How the coordinator reaches workers: TLS files (None = plaintext) and a bearer token (None = none)."""

    tls: TlsFiles | None = None
    token: str | None = None

    def channel(self, address: str, options: list) -> grpc.Channel:
        if self.tls is not None and self.tls.enabled:
            options = list(options)
            if self.tls.server_name:
                options.append(("grpc.ssl_target_name_override", self.tls.server_name))
            channel = grpc.secure_channel(address, self.tls.channel_credentials(), options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        return grpc.intercept_channel(channel, _TokenMetadata(self.token)) if self.token else channel


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, tls: TlsFiles | None, token: str | None) -> str | None:
    """A loud warning when a worker listens beyond loopback without both TLS and a token."""
    if is_loopback(host) or (tls is not None and tls.enabled and token):
        return None
    missing = " and ".join(m for m, ok in (("TLS", tls is not None and tls.enabled), ("a token", token)) if not ok)
    return ("!" * 78 + f"\nWARNING: listening on {host} without {missing}: anyone who can reach this port can use "
            "this model and read or disturb its sessions.\nUse --tls-cert/--tls-key (and --tls-ca for mutual TLS) "
            f"and ${TOKEN_ENV} or --token-file.\n" + "!" * 78)

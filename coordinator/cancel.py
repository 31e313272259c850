"""Cancelling a generation from outside (an HTTP client that went away, a server shutting down).

A CancelToken is handed to a generation's sessions. Cancelling it cancels the RPCs in flight at once (the worker
sees the call end and drops it before it costs a forward pass), interrupts retry backoff, and makes the next step
raise GenerationCancelled, so the generation ends its sessions (EndSession) and runs nothing more.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc


class GenerationCancelled(Exception):
    """The generation was cancelled by its caller; `partial` holds what was generated before (when known)."""

    def __init__(self, message: str, partial=None) -> None:
        super().__init__(message)
        self.partial = partial


class CancelToken:
    """Set once, from any thread; the generation's threads notice at their next RPC, backoff or step."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._calls: set = set()  # gRPC futures in flight
        self.reason = ""

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self, reason: str = "cancelled by the caller") -> None:
        with self._lock:
            if self._event.is_set():
                return
            self.reason = reason
            self._event.set()
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def check(self) -> None:
        if self._event.is_set():
            raise GenerationCancelled(self.reason)

    def sleep(self, seconds: float) -> None:
        """A retry backoff that a cancel cuts short (the next attempt then raises)."""
        self._event.wait(seconds)

    @contextmanager
    def tracking(self, call) -> Iterator[None]:
        """Cancel `call` (a gRPC future or response stream) at once if the token is cancelled while the block runs."""
        with self._lock:
            self._calls.add(call)
        if self._event.is_set():  # cancelled before registration
            call.cancel()
        try:
            yield
        finally:
            with self._lock:
                self._calls.discard(call)

    def call(self, method, request, timeout: float):
        """`method(request, timeout=timeout)` (a gRPC unary-unary callable), cancelled at once if the token is."""
        self.check()
        future = method.future(request, timeout=timeout)
        try:
            with self.tracking(future):
                return future.result()
        except grpc.FutureCancelledError:
            raise GenerationCancelled(self.reason) from None
        except grpc.RpcError as e:
            if self._event.is_set() and e.code() == grpc.StatusCode.CANCELLED:
                raise GenerationCancelled(self.reason) from None
            raise

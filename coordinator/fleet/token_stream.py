"""Reading a verifier's Decode stream with a deadline per token.

A gRPC deadline covers a whole call, but a stream of target-only steps lasts as long as the generation: what must be
bounded is the wait for each next token, as each Verify call's deadline bounds one step. A watchdog thread cancels the
call when a token is late; the read then fails with StreamStalled (DEADLINE_EXCEEDED: retryable, counted against the
verifier's breaker), so a hung verifier is left as fast as one that hangs on a Verify.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import grpc

from coordinator.cancel import CancelToken, GenerationCancelled
from specmesh.v1 import specmesh_pb2 as pb


class StreamStalled(grpc.RpcError):
    """No token arrived within the step deadline."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no token for {seconds:g} s")
        self._details = f"the verifier sent no token for {seconds:g} s"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details


class TokenStream:
    """A Decode response stream: next() gives the next response, None once the stream ends. The first response may
    take `first_timeout_s` (it includes the prefill of the history sent with the call), every later one
    `step_timeout_s`. A cancel of the generation's CancelToken cancels the stream (GenerationCancelled)."""

    def __init__(self, call, first_timeout_s: float, step_timeout_s: float,
                 cancel: CancelToken | None = None) -> None:
        self._call, self._step_timeout_s, self._cancel = call, step_timeout_s, cancel
        self._timeout_s = first_timeout_s
        self._deadline = time.monotonic() + first_timeout_s
        self._stalled = False
        self._ended = threading.Event()
        self._tracking = ExitStack()
        if cancel is not None:
            self._tracking.enter_context(cancel.tracking(call))
        threading.Thread(target=self._watch, name="stream-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._ended.wait(max(self._deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= self._deadline:
                self._stalled = True
                self._call.cancel()
                return

    def next(self) -> pb.DecodeResponse | None:
        try:
            response = next(self._call)
        except StopIteration:
            self.close()
            return None
        except grpc.RpcError as e:
            self.close()
            if self._stalled:
                raise StreamStalled(self._timeout_s) from None
            if self._cancel is not None and self._cancel.cancelled and e.code() == grpc.StatusCode.CANCELLED:
                raise GenerationCancelled(self._cancel.reason) from None
            raise
        self._timeout_s = self._step_timeout_s
        self._deadline = time.monotonic() + self._step_timeout_s
        return response

    def close(self) -> None:
        """End the stream (a no-op on one that has ended): the verifier stops within a step."""
        self._ended.set()
        self._call.cancel()
        self._tracking.close()

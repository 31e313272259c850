"""In-process fakes of drafter and verifier workers for the coordinator's session and pool logic: no servers, no
models, no sockets. A fake keeps real session histories (so resyncs and lost replies behave as on a real worker),
decides tokens with a toy deterministic "model", and fails on command with a chosen gRPC status code."""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2

from specmesh.v1 import specmesh_pb2 as pb
from specmesh.wire.contract import RESYNC_PREFIX
from specmesh.wire.history import ResyncRequired, TokenHistory

VOCAB = 50


def target_next(tokens: Sequence[int]) -> int:
    """The toy target's greedy token after `tokens`."""
    return (tokens[-1] * 7 + 3) % VOCAB if tokens else 1


def target_continuation(prompt: Sequence[int], n: int) -> list[int]:
    """What plain target decoding generates: the output every speculative run must equal."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(target_next(tokens))
    return tokens[len(prompt):]


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Fault:
    """A scripted failure: raise `error` before the call is served, or (`after_serving`) once the server has done
    the work, as when a reply is lost or arrives after the deadline."""

    def __init__(self, code: grpc.StatusCode, details: str = "", after_serving: bool = False) -> None:
        self.error, self.after_serving = FakeRpcError(code, details), after_serving


class FakeHealth:
    """A grpc.health.v1 stub whose Watch stream reports what the test sets."""

    def __init__(self) -> None:
        self._statuses: queue.Queue = queue.Queue()
        self.set(True)

    def set(self, serving: bool) -> None:
        self._statuses.put(health_pb2.HealthCheckResponse.SERVING if serving
                           else health_pb2.HealthCheckResponse.NOT_SERVING)

    def close(self) -> None:
        self._statuses.put(None)

    def Watch(self, request):  # noqa: N802 (the gRPC method name)
        while (status := self._statuses.get()) is not None:
            yield health_pb2.HealthCheckResponse(status=status)
        raise FakeRpcError(grpc.StatusCode.CANCELLED, "channel closed")


class FakeStub:
    """Propose / Verify / Info over per-session histories, with scripted faults. `requests` records every call that
    reached the stub (failed ones included) as (method, request)."""

    def __init__(self, role: str, draft_error_at: int | None = None) -> None:
        self.role = role
        self.draft_error_at = draft_error_at  # the drafter's k-th draft token is wrong: partial acceptance
        self.sessions: dict[str, TokenHistory] = {}
        self.faults: deque[Fault] = deque()
        self.down = False  # every call fails UNAVAILABLE, as on a dead worker
        self.requests: list[tuple[str, object]] = []
        self.ended: list[str] = []
        self.hang_decode_after: int | None = None  # a Decode stream sends this many tokens, then nothing (hung)
        self.decode_unimplemented = False  # an older verifier: Decode answers UNIMPLEMENTED

    def _call(self, method: str, request, serve, record: bool = True):
        if record:
            self.requests.append((method, request))
        if self.down:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")
        fault = self.faults.popleft() if self.faults else None
        if fault is not None and not fault.after_serving:
            raise fault.error
        reply = serve(request)
        if fault is not None:
            raise fault.error
        return reply

    def _synced(self, session_id: str, context: pb.ContextSync, extra: Sequence[int] = ()) -> TokenHistory:
        history = self.sessions.setdefault(session_id, TokenHistory())
        try:
            history.apply_sync(context.base_length, context.base_hash, [*context.new_tokens, *extra])
        except ResyncRequired as e:
            raise FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{RESYNC_PREFIX} {e}") from None
        return history

    def _verify(self, request: pb.VerifyRequest) -> pb.VerifyResponse:
        history = self._synced(request.session_id, request.context)
        tokens, accepted = list(history.tokens), 0
        for draft in request.draft_tokens:
            if draft != target_next(tokens):
                break
            tokens.append(draft)
            accepted += 1
        next_token = target_next(tokens)
        history.extend([*request.draft_tokens[:accepted], next_token])
        return pb.VerifyResponse(accepted=accepted, next_token=next_token, committed_length=len(history))

    def _propose(self, request: pb.ProposeRequest) -> pb.ProposeResponse:
        history = self._synced(request.session_id, request.context)
        tokens, drafts = list(history.tokens), []
        for i in range(request.num_tokens):
            token = target_next(tokens)
            if i == self.draft_error_at:
                token = (token + 1) % VOCAB
            tokens.append(token)
            drafts.append(token)
        return pb.ProposeResponse(tokens=drafts, committed_length=len(history))

    def _decode_step(self, stream: "FakeDecodeStream") -> pb.DecodeResponse:
        request = stream.request
        if not stream.sent:
            history = self._synced(request.session_id, request.context)
        else:  # later steps build on the stream's own commits, as the real verifier's do
            history = self.sessions.get(request.session_id)
            if history is None or len(history) != stream.committed_length:
                raise FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, f"{RESYNC_PREFIX} session changed")
        token = target_next(history.tokens)
        history.extend([token])
        return pb.DecodeResponse(token=token, committed_length=len(history))

    def Decode(self, request: pb.DecodeRequest) -> "FakeDecodeStream":  # noqa: N802
        self.requests.append(("Decode", request))
        return FakeDecodeStream(self, request)

    def Verify(self, request: pb.VerifyRequest, timeout: float | None = None) -> pb.VerifyResponse:  # noqa: N802
        return self._call("Verify", request, self._verify)

    def Propose(self, request: pb.ProposeRequest, timeout: float | None = None) -> pb.ProposeResponse:  # noqa: N802
        return self._call("Propose", request, self._propose)

    def Info(self, request: pb.InfoRequest, timeout: float | None = None) -> pb.InfoResponse:  # noqa: N802
        return self._call("Info", request, lambda _: pb.InfoResponse(model_name="toy", role=self.role))

    def contexts(self, method: str) -> list[pb.ContextSync]:
        return [request.context for name, request in self.requests if name == method]


HELD_PER_MESSAGE = 3  # a fake stream with flush_interval_ms sends the steps after its first three to a message


class FakeDecodeStream:
    """What a fake Decode call returns: an iterator of DecodeResponse with cancel(), as a gRPC response stream. Each
    next() is one target step (three after the first with flush_interval_ms), and fails as a unary call would (the
    worker is down, a scripted fault)."""

    def __init__(self, stub: FakeStub, request: pb.DecodeRequest) -> None:
        self.stub, self.request = stub, request
        self.sent, self.committed_length = 0, 0
        self.last_token: int | None = None
        self._cancel = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self) -> "FakeDecodeStream":
        return self

    def __next__(self) -> pb.DecodeResponse:
        if self.cancelled:
            raise FakeRpcError(grpc.StatusCode.CANCELLED, "cancelled by the client")
        if self.sent >= self.request.max_tokens or self.last_token in self.request.stop_token_ids:
            raise StopIteration
        if self.stub.decode_unimplemented:
            raise FakeRpcError(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        if self.stub.hang_decode_after is not None and self.sent >= self.stub.hang_decode_after:
            self._cancel.wait(10.0)  # until the client gives up on it
            raise FakeRpcError(grpc.StatusCode.CANCELLED, "cancelled by the client")
        held = HELD_PER_MESSAGE if self.request.flush_interval_ms and self.sent else 1  # the first goes alone
        tokens = []
        while len(tokens) < held and self.sent < self.request.max_tokens and \
                self.last_token not in self.request.stop_token_ids:
            step = self.stub._call("Decode", self.request, lambda _: self.stub._decode_step(self), record=False)
            self.sent += 1
            self.committed_length, self.last_token = step.committed_length, step.token
            tokens.append(step.token)
        return pb.DecodeResponse(token=tokens[0], more_tokens=tokens[1:], committed_length=self.committed_length)

    def cancel(self) -> bool:
        self._cancel.set()
        return True


class FakeWorker:
    """What WorkerPool's `connect` returns: the RemoteWorker surface an Endpoint uses, over a FakeStub."""

    def __init__(self, address: str, role: str, draft_error_at: int | None = None) -> None:
        self.address, self.role = address, role
        self.stub = FakeStub(role, draft_error_at)
        self.health = FakeHealth()
        self.closed = False

    def info(self, timeout_s: float = 10.0) -> pb.InfoResponse:
        return self.stub.Info(pb.InfoRequest(), timeout=timeout_s)

    def end_session(self, session_id: str) -> None:
        self.stub.ended.append(session_id)

    def kill(self) -> None:
        """Gone: calls fail UNAVAILABLE and health reports NOT_SERVING."""
        self.stub.down = True
        self.health.set(False)

    def restart(self) -> None:
        """Back, with every session forgotten (its KV caches died with the process)."""
        self.stub.sessions.clear()
        self.stub.down = False
        self.health.set(True)

    def close(self) -> None:
        self.closed = True
        self.health.close()


class FakeFleet:
    """FakeWorkers by address, and the `connect` factory that hands them to a WorkerPool."""

    def __init__(self, role: str, count: int, draft_error_at: int | None = None) -> None:
        self.workers = {f"fake-{role}-{i}:1": FakeWorker(f"fake-{role}-{i}:1", role, draft_error_at)
                        for i in range(count)}

    @property
    def addresses(self) -> list[str]:
        return list(self.workers)

    def connect(self, address: str, role: str) -> FakeWorker:
        return self.workers[address]

    def __getitem__(self, index: int) -> FakeWorker:
        return list(self.workers.values())[index]

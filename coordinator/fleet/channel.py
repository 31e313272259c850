"""What every client of a drafter or verifier shares: channel options, session ids, and the history sync.

Each session (coordinator/fleet/remote_sessions.py) remembers how much of the committed history its server already holds,
and sends only the tokens committed since (plus the length and rolling hash of the prefix they build on). When a
server answers "resync" (unknown session, restarted or different server, diverged history) the call is repeated once
with the full history, and the server rebuilds its KV cache from it: nothing is lost.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import grpc
import grpc.experimental

from specmesh.wire.history import TokenHistory
from specmesh.wire.contract import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, RESYNC_PREFIX
from specmesh.v1 import specmesh_pb2 as pb

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # How long grpcio waits for a ping's answer (it ignores keepalive_timeout_ms for that): a hung peer's end.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.enable_retries", 0),  # retries belong to the coordinator's own policy, never stacked on the channel's
    # A response stream (Decode, health Watch) is read on the reading thread itself, not handed over by the channel's
    # spin thread: a third less of the coordinator's CPU per streamed token (0.58-0.69 ms against 0.69-1.01 ms on the
    # real pair), CPU that the verifier's threads share on small machines.
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
]


def new_session_id() -> str:
    return uuid.uuid4().hex  # 122 random bits: unguessable, so no client can address another's session


def is_resync(error: grpc.RpcError) -> bool:
    return (error.code() == grpc.StatusCode.FAILED_PRECONDITION
            and (error.details() or "").startswith(RESYNC_PREFIX))


class SyncedHistory:
    """The committed history plus how much of it the server holds."""

    def __init__(self, tokens: Sequence[int], stats=None) -> None:
        self.history = TokenHistory(tokens)
        self.stats = stats  # anything with a `resyncs` counter
        self.server_length = 0  # the server has seen nothing yet: the first call carries the whole prompt

    def context(self, full: bool = False) -> pb.ContextSync:
        base = 0 if full else self.server_length
        return pb.ContextSync(base_length=base, base_hash=self.history.hash_at(base),
                              new_tokens=self.history.tokens[base:])

    def call(self, rpc: Callable[[pb.ContextSync], object]) -> object:
        """Run `rpc(context)`; on a resync answer, once more with the full history."""
        try:
            return rpc(self.context())
        except grpc.RpcError as e:
            if not is_resync(e):
                raise
        if self.stats is not None:
            self.stats.resyncs += 1
        return rpc(self.context(full=True))

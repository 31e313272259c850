"""Client sessions for remote drafter and verifier services, implementing the loop's DraftSource/TargetSession.

Each session remembers how much of the committed history its server already holds, and sends only the tokens
committed since (plus the length and rolling hash of the prefix they build on). When a server answers "resync"
(unknown session, restarted or different server, diverged history) the call is repeated once with the full history,
and the server rebuilds its KV cache from it: nothing is lost.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import grpc

from coordinator.loop import Draft
from specmesh.acceptance import Verdict
from specmesh.history import TokenHistory
from specmesh.sampling import SamplingParams, SparseDist
from specmesh.serving import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, RESYNC_PREFIX
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.enable_retries", 0),  # retries belong to the coordinator's own policy, never stacked on the channel's
]


def new_session_id() -> str:
    return uuid.uuid4().hex  # 122 random bits: unguessable, so no client can address another's session


def is_resync(error: grpc.RpcError) -> bool:
    return (error.code() == grpc.StatusCode.FAILED_PRECONDITION
            and (error.details() or "").startswith(RESYNC_PREFIX))


def sampling_to_wire(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


class SyncedHistory:
    """The committed history plus how much of it the server holds."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.history = TokenHistory(tokens)
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
        return rpc(self.context(full=True))


class RemoteDraftSession:
    def __init__(self, stub: pb_grpc.DrafterStub, session_id: str, prompt: Sequence[int], params: SamplingParams,
                 seed: int, timeout_s: float) -> None:
        self._stub, self.session_id, self._params, self._seed = stub, session_id, params, seed
        self._timeout_s = timeout_s
        self.sync = SyncedHistory(prompt)

    def propose(self, k: int) -> Draft:
        def rpc(context: pb.ContextSync) -> pb.ProposeResponse:
            return self._stub.Propose(pb.ProposeRequest(
                session_id=self.session_id, context=context, num_tokens=k,
                sampling=sampling_to_wire(self._params), seed=self._seed), timeout=self._timeout_s)

        response = self.sync.call(rpc)
        # The drafter now holds the committed history; its drafts are not committed until update().
        self.sync.server_length = len(self.sync.history)
        dists = tuple(SparseDist(tuple(d.token_ids), tuple(d.probs)) for d in response.distributions)
        return Draft(tuple(response.tokens), dists)

    def update(self, committed: Sequence[int]) -> None:
        self.sync.history.extend(committed)


class RemoteTargetSession:
    def __init__(self, stub: pb_grpc.VerifierStub, session_id: str, prompt: Sequence[int], params: SamplingParams,
                 seed: int, timeout_s: float) -> None:
        self._stub, self.session_id, self._params, self._seed = stub, session_id, params, seed
        self._timeout_s = timeout_s
        self.sync = SyncedHistory(prompt)

    def verify(self, draft: Draft) -> Verdict:
        def rpc(context: pb.ContextSync) -> pb.VerifyResponse:
            return self._stub.Verify(pb.VerifyRequest(
                session_id=self.session_id, context=context, draft_tokens=list(draft.tokens),
                draft_distributions=[pb.SparseDistribution(token_ids=list(d.token_ids), probs=list(d.probs))
                                     for d in draft.dists],
                sampling=sampling_to_wire(self._params), seed=self._seed), timeout=self._timeout_s)

        response = self.sync.call(rpc)
        verdict = Verdict(accepted=response.accepted, next_token=response.next_token)
        # The verifier commits the accepted drafts and its own token itself, so next round sends nothing new.
        self.sync.history.extend([*draft.tokens[:verdict.accepted], verdict.next_token])
        self.sync.server_length = len(self.sync.history)
        if response.committed_length != len(self.sync.history):
            self.sync.server_length = 0  # disagreement about the history: rebuild it from scratch next call
        return verdict

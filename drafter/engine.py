"""Draft generation with a draft model on a session's KV cache, free of gRPC."""

from __future__ import annotations

import threading
from collections.abc import Callable

from drafter.proposer import Proposal
from specmesh.decoding.sampling import SamplingParams, SparseDist, draft_sample
from specmesh.runtime.engine import ModelEngine, as_engine
from specmesh.wire.contract import Cancelled
from specmesh.wire.history import EMPTY_HASH, TokenHistory
from specmesh.worker.cost_probe import PROBE_DRAFTS, fastest_runs, probe_context
from specmesh.worker.role import ModelDescription
from specmesh.worker.session_store import SessionLimits, SessionStore, kv_sessions


class DraftEngine:
    """A Proposer (drafter/proposer.py) drafting k tokens autoregressively with the draft model.

    The drafts stay in the session's KV cache; the next call's context sync says which of them were accepted, and the
    cache rolls back to the longest prefix shared with the new committed history (explicit rollback of the rest).
    """

    def __init__(self, loaded: ModelEngine, limits: SessionLimits = SessionLimits()) -> None:
        self.loaded = loaded = as_engine(loaded)  # the model engine: transformers or llama.cpp
        self.description = ModelDescription.of(loaded)
        self.sessions = SessionStore(limits, kv_sessions(loaded))
        self._lock = threading.Lock()  # one forward pass at a time: CPU threads are already all in use
        self.draft_per_token_s = 0.0  # measured by warm_up

    def propose(self, session_id: str, base_length: int, base_hash: int, new_tokens: list[int], k: int,
                params: SamplingParams, seed: int, is_active: Callable[[], bool] = lambda: True) -> Proposal:
        with self._lock:
            session = self.sessions.synced(session_id, base_length, base_hash, new_tokens)
            committed = list(session.history.tokens)
            sequence = list(committed)
            tokens: list[int] = []
            dists: list[SparseDist] = []
            for _ in range(k):
                if not is_active():  # the caller gave up: free the model for calls that still matter
                    raise Cancelled("the call was cancelled or its deadline passed while drafting")
                logits = session.sequence.logits_for(sequence, last_n=1)[0]
                draft = draft_sample(logits, params, seed, position=len(sequence))
                tokens.append(draft.token)
                if draft.dist is not None:
                    dists.append(draft.dist)
                sequence.append(draft.token)
            self.sessions.enforce_memory()
            return Proposal(tuple(tokens), tuple(dists), len(committed))

    def end_session(self, session_id: str) -> bool:
        return self.sessions.end(session_id)

    def warm_up(self) -> None:
        """One proposal so the first real call is not slow; then measure seconds per draft token (the fastest of a
        few proposals, on a short context), the coordinator's prior for its draft length policy."""
        context = probe_context(self.loaded.vocab_size)
        self.propose("warm-up", 0, EMPTY_HASH, context, 1, SamplingParams(), 0)
        context_hash = TokenHistory(context).hash_at(len(context))
        # The drafts are rejected: each proposal drafts from the same context.
        seconds = fastest_runs({"propose": lambda: self.propose("warm-up", len(context), context_hash, [],
                                                                PROBE_DRAFTS, SamplingParams(), 0)})
        self.end_session("warm-up")
        self.draft_per_token_s = seconds["propose"] / PROBE_DRAFTS

"""Draft generation on a session's KV cache, free of gRPC."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from specmesh.history import EMPTY_HASH
from specmesh.models import LoadedModel
from specmesh.sampling import SamplingParams, SparseDist, draft_sample
from specmesh.serving import Cancelled
from specmesh.sessions import SessionLimits, SessionStore, kv_sessions


@dataclass(frozen=True)
class Proposal:
    tokens: tuple[int, ...]
    dists: tuple[SparseDist, ...]  # empty when greedy
    committed_length: int


class DraftEngine:
    """Proposes k tokens autoregressively with the draft model.

    The drafts stay in the session's KV cache; the next call's context sync says which of them were accepted, and the
    cache rolls back to the longest prefix shared with the new committed history (explicit rollback of the rest).
    """

    def __init__(self, loaded: LoadedModel, limits: SessionLimits = SessionLimits()) -> None:
        self.loaded = loaded
        self.sessions = SessionStore(limits, kv_sessions(loaded.model))
        self._lock = threading.Lock()  # one forward pass at a time: CPU threads are already all in use

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

    def warm_up(self) -> None:
        self.propose("warm-up", 0, EMPTY_HASH, [0, 1, 2, 3], 2, SamplingParams(), 0)
        self.sessions.end("warm-up")


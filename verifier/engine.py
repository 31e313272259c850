"""Verification of draft tokens in ONE target forward pass on a session's KV cache, free of gRPC."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from specmesh.acceptance import Verdict, decide
from specmesh.history import EMPTY_HASH
from specmesh.models import LoadedModel
from specmesh.sampling import SamplingParams, SparseDist
from specmesh.sessions import SessionLimits, SessionStore, kv_sessions


@dataclass(frozen=True)
class VerifyOutcome:
    verdict: Verdict
    committed_length: int


class VerifyEngine:
    def __init__(self, loaded: LoadedModel, limits: SessionLimits = SessionLimits()) -> None:
        self.loaded = loaded
        self.sessions = SessionStore(limits, kv_sessions(loaded.model))
        self._lock = threading.Lock()  # one forward pass at a time

    def verify(self, session_id: str, base_length: int, base_hash: int, new_tokens: list[int],
               drafts: list[int], dists: list[SparseDist], params: SamplingParams, seed: int) -> VerifyOutcome:
        with self._lock:
            session = self.sessions.synced(session_id, base_length, base_hash, new_tokens)
            committed = session.history.tokens
            start = len(committed)
            # Row i of target_logits is the target's distribution for position start + i: k draft positions + bonus.
            target_logits = session.sequence.logits_for(committed + list(drafts), last_n=len(drafts) + 1)
            verdict = decide(drafts, dists, target_logits, params, seed, start)
            # Keep the KV of the accepted drafts only; the next token's KV is computed on the next call.
            session.sequence.rollback(start + verdict.accepted)
            session.history.extend([*drafts[:verdict.accepted], verdict.next_token])
            self.sessions.enforce_memory()
            return VerifyOutcome(verdict, len(session.history))

    def warm_up(self) -> None:
        self.verify("warm-up", 0, EMPTY_HASH, [0, 1, 2, 3], [4, 5], [], SamplingParams(), 0)
        self.sessions.end("warm-up")

"""What a drafter is to its service: a Proposer. The draft model (drafter/engine.py), prompt lookup
(drafter/ngram.py) and SuffixDecoding (drafter/suffix.py) are three of them; drafter/service.py talks to this protocol
only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from specmesh.decoding.sampling import SamplingParams, SparseDist
from specmesh.worker.role import ModelDescription
from specmesh.worker.session_store import SessionStore


@dataclass(frozen=True)
class Proposal:
    tokens: tuple[int, ...]  # at most k; fewer (even none) when the drafter has nothing better to offer
    dists: tuple[SparseDist, ...]  # one per token when sampling, empty when greedy
    committed_length: int  # the session's history the tokens follow


class Proposer(Protocol):
    """Drafts k tokens per call for many client sessions.

    There is no separate "accepted" call: each proposal starts by syncing the session to the client's committed
    history (base length + hash, then the new tokens), which tells the proposer what of its last proposal was
    accepted; whatever it kept for the rejected part (KV cache, index) is rolled back then.
    """

    description: ModelDescription  # what Info reports about the drafter's model
    sessions: SessionStore
    # The coordinator's prior for its draft length policy: cached, or measured after warm_up (0 until then, and for
    # proposers with nothing worth measuring).
    draft_per_token_s: float

    def propose(self, session_id: str, base_length: int, base_hash: int, new_tokens: list[int], k: int,
                params: SamplingParams, seed: int, is_active: Callable[[], bool] = lambda: True) -> Proposal:
        """Sync the session to the client's history, then propose up to k tokens after it. Raises ResyncRequired
        when the session's history is not the one the client builds on, Cancelled once `is_active()` is False."""

    def end_session(self, session_id: str) -> bool:
        """Forget a session; False when it was not held."""

    def warm_up(self) -> None:
        """Make the first proposals before serving; set draft_per_token_s when cached, else start measuring it in the
        background (a proposer that does stops it in stop_background_work)."""

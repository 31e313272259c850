"""SuffixDecoding (Oliaro et al., arXiv:2411.04975; vLLM's "suffix" method), `drafter serve --method suffix`.

Model-free like the n-gram drafter (drafter/ngram.py), but with frequencies and a memory across requests:
  * a per-session suffix tree over the session's prompt and committed output, updated as each Propose syncs the
    history (drafter/suffix_tree.py SessionTree);
  * ONE global suffix tree per drafter process over the outputs of earlier requests (their prompts too with
    `index_prompts`), shared by every coordinator that talks to this drafter: a session that ends (EndSession) or
    that the session store drops (evicted, idle past its TTL) adds what it produced. It keeps at most `max_tokens`
    tokens and `max_requests` requests, the oldest evicted first (GlobalTree).
Each Propose matches the history's longest suffix in both trees, walks the most frequent continuation from there and
keeps the better draft: the longer match, then the higher score (the sum of the draft's estimated prefix
probabilities), as the paper does. Choices:
  * draft length: at most spec_factor x match length (the paper's alpha; default 1: a 2-token match drafts at most 2
    tokens, a 16-token match 16) and at most k, the coordinator's bound;
  * stop where the draft's estimated probability (the product of child count / sum of sibling counts along the
    walk) falls below min_prob (default 0.1, the paper's threshold);
  * the match is at most max_depth - k tokens long, so that k tokens fit below it in the depth-bounded tree.

As for the n-gram drafter, the proposal is deterministic given the history and the trees, so under sampling its draft
distribution is a point mass on each proposed token and speculative sampling keeps the output distributed exactly as
the target's. The tree frequencies only choose the tokens; they are not q. The global tree learns from every request,
so a seeded sampled request run twice may get other drafts the second time, and with them another (equally
distributed) sample: seeds reproduce a run only against the same drafter state.

Left to the coordinator's history: what the drafter holds is what the client synced, so the tokens committed by the
last round of a request (never synced: no Propose follows) are not recorded, and a pipelined request's last bet
(drafts past the committed history) may be.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from drafter.proposer import Proposal
from drafter.suffix_tree import DEFAULT_MAX_DEPTH, NO_CANDIDATE, Candidate, GlobalTree, SessionTree
from specmesh.decoding.sampling import SamplingParams, SparseDist
from specmesh.wire.contract import Cancelled
from specmesh.wire.history import EMPTY_HASH, TokenHistory
from specmesh.worker.role import ModelDescription
from specmesh.worker.session_store import SessionLimits, SessionStore

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 100_000  # global tree: about 20 MB at ~200 bytes per token
DEFAULT_MAX_REQUESTS = 1_000
DEFAULT_SPEC_FACTOR = 1.0
DEFAULT_MIN_PROB = 0.1
DEFAULT_UNDO_TOKENS = 128  # a session's tree undoes this many recent tokens (pipelined bets, retries) without rebuild


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = DEFAULT_MAX_DEPTH  # longest substring indexed: match length + draft length
    max_tokens: int = DEFAULT_MAX_TOKENS  # global tree: tokens kept across finished requests
    max_requests: int = DEFAULT_MAX_REQUESTS  # global tree: finished requests kept
    spec_factor: float = DEFAULT_SPEC_FACTOR  # draft at most spec_factor x match length tokens
    min_prob: float = DEFAULT_MIN_PROB  # stop drafting below this estimated probability
    index_prompts: bool = False  # the global tree also holds finished requests' prompts (with their outputs)

    def __post_init__(self) -> None:
        if self.max_depth < 2:
            raise ValueError(f"max_depth (--suffix-max-depth) must be >= 2, got {self.max_depth}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens (--suffix-max-tokens) must be >= 1, got {self.max_tokens}")
        if self.max_requests < 1:
            raise ValueError(f"max_requests (--suffix-max-requests) must be >= 1, got {self.max_requests}")
        if not self.spec_factor > 0:
            raise ValueError(f"spec_factor (--suffix-spec-factor) must be > 0, got {self.spec_factor}")
        if not 0 <= self.min_prob <= 1:
            raise ValueError(f"min_prob (--suffix-min-prob) must be in [0, 1], got {self.min_prob}")


def better(a: Candidate, b: Candidate) -> Candidate:
    """The draft to propose of two: one with tokens, then the longer match, then the higher score (a on ties)."""
    if not b.tokens:
        return a
    if not a.tokens:
        return b
    return a if (a.match_length, a.score) >= (b.match_length, b.score) else b


@dataclass
class SuffixSession:
    history: TokenHistory
    tree: SessionTree
    prompt_length: int | None = None  # the history's length at the first sync: what came before the output
    record: bool = True  # False: its tokens stay out of the global tree (the warm-up)
    num_bytes = 0  # no KV cache: a token list and its tree, bounded by the store's count and TTL


class SuffixEngine:
    """A Proposer (drafter/proposer.py) drafting by SuffixDecoding."""

    draft_per_token_s = 0.0  # no model: a lookup costs well under a millisecond

    def __init__(self, description: ModelDescription, limits: SessionLimits = SessionLimits(),
                 config: SuffixConfig = SuffixConfig(), undo_tokens: int = DEFAULT_UNDO_TOKENS) -> None:
        self.description = description
        self.config = config
        self.undo_tokens = undo_tokens
        self.global_tree = GlobalTree(config.max_depth, config.max_tokens, config.max_requests)
        self._ended: deque[SuffixSession] = deque()  # sessions that left the store, not yet in the global tree
        self.sessions = SessionStore(limits, self._new_session, on_remove=lambda _, s: self._ended.append(s))
        # One lock for the sessions (sync, session tree, lookup: a session's calls in order, even a retry's), one for
        # the global tree, so that adding a finished request there does not hold up other sessions' syncs.
        self._lock = threading.Lock()
        self._global_lock = threading.Lock()
        self._recording = True

    def _new_session(self) -> SuffixSession:
        return SuffixSession(TokenHistory(), SessionTree(self.config.max_depth, self.undo_tokens),
                             record=self._recording)

    def propose(self, session_id: str, base_length: int, base_hash: int, new_tokens: list[int], k: int,
                params: SamplingParams, seed: int, is_active: Callable[[], bool] = lambda: True) -> Proposal:
        if not is_active():
            raise Cancelled("the call was cancelled or its deadline passed before drafting")
        self._record_ended()
        config = self.config
        with self._lock:
            session = self.sessions.synced(session_id, base_length, base_hash, new_tokens)
            try:
                self._sync_tree(session, base_length)
            except BaseException:
                session.tree.clear()  # whatever happened to it, the next call rebuilds it from the history
                raise
            tokens = session.history.tokens
            committed = len(tokens)
            own = session.tree.speculate(session.tree.tokens, k, config.spec_factor, config.min_prob)
            context = tokens[max(0, committed - config.max_depth):]
        with self._global_lock:
            shared = (self.global_tree.speculate(context, k, config.spec_factor, config.min_prob)
                      if self.global_tree.num_tokens else NO_CANDIDATE)
        draft = better(own, shared).tokens
        # Deterministic proposal: under sampling q is a point mass on each proposed token (seed is not needed).
        dists = () if params.is_greedy else tuple(SparseDist((t,), (1.0,)) for t in draft)
        return Proposal(draft, dists, committed)

    @staticmethod
    def _sync_tree(session: SuffixSession, base_length: int) -> None:
        """Bring the session's tree to its (just synced) history: the tree held the history as it was before this
        sync, which kept its first base_length tokens; what follows may still be the same (a retry, a pipelined bet
        that was accepted)."""
        tree, history = session.tree, session.history.tokens
        same = min(base_length, len(tree))
        limit = min(len(tree), len(history))
        while same < limit and tree.tokens[same] == history[same]:
            same += 1
        if session.prompt_length is None:  # a new session: its first sync brings the prompt
            session.prompt_length = len(history)
        elif same < session.prompt_length:  # the client restarted the context from recent tokens: no prompt left
            session.prompt_length = same
        tree.truncate(same)
        tree.extend(history[same:])

    def end_session(self, session_id: str) -> bool:
        ended = self.sessions.end(session_id)
        self._record_ended()
        return ended

    def _record_ended(self) -> None:
        """Add what the sessions that left the store produced to the global tree."""
        while self._ended:
            try:
                session = self._ended.popleft()
            except IndexError:  # taken by another thread meanwhile
                return
            if not session.record:
                continue
            with self._lock:  # a call still holding the session has finished with it
                start = 0 if self.config.index_prompts else (session.prompt_length or 0)
                tokens = session.history.tokens[start:]
                session.tree = SessionTree(2)  # free it now
            if tokens:
                with self._global_lock:
                    self.global_tree.add(tokens)
                    log.debug("global suffix tree: +%d tokens, now %d tokens of %d requests", len(tokens),
                              self.global_tree.num_tokens, len(self.global_tree.sequences))

    def warm_up(self) -> None:
        self._recording = False  # nothing of the warm-up goes into the global tree
        try:
            self.propose("warm-up", 0, EMPTY_HASH, [0, 1, 2, 0, 1], 2, SamplingParams(), 0)
            self.end_session("warm-up")
        finally:
            self._recording = True


__all__ = ["SuffixConfig", "SuffixEngine", "SuffixSession", "better"]

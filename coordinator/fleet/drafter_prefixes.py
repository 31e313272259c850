"""What the draft model's workers likely hold in their prefix caches: the tokens of the sessions this coordinator
recently opened on them, as the workers' caches keep them (coordinator/fleet/remote_sessions.py, LazyDraftSource).

A draft model session opens by prefilling its window of the conversation, less the longest prefix a worker still holds
from an earlier session (its prefix cache, docs/engines.md). What that prefix is decides what opening the session
costs: on the real pair (2-core Zen 4) 0.08-0.1 s where the last turn's session left the window's start cached, and
1.0-1.2 s for a 350-400 token window new to the drafter (a new document, or a window that moved on by 256 tokens).
The workers do not say what they hold before the prefill; this mirror of what was sent to them does, for the sessions
opened through this coordinator (another coordinator's sessions, or an eviction, make it an estimate)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

REMEMBERED_SESSIONS = 16  # as many as an ik worker's contexts (its prefix cache holds at most 16 sessions' cells)


class DrafterPrefixes:
    """The token lists of the last REMEMBERED_SESSIONS draft model sessions (each growing while its session learns
    committed tokens). Thread-safe: `coordinator serve` opens sessions concurrently."""

    def __init__(self, remembered: int = REMEMBERED_SESSIONS) -> None:
        if remembered < 1:
            raise ValueError(f"remembered must be >= 1, got {remembered}")
        self._sessions: deque[list[int]] = deque(maxlen=remembered)
        self._lock = threading.Lock()

    def opened(self, tokens: list[int]) -> None:
        """A session opened on `tokens`; the list is kept as given, so tokens the caller appends later (what the
        session learned) count too."""
        with self._lock:
            self._sessions.append(tokens)

    def cached(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` a remembered session holds (the longest common prefix)."""
        with self._lock:
            sessions = list(self._sessions)
        best = 0
        for held in sessions:
            n = min(len(held), len(tokens))
            same = 0
            while same < n and held[same] == tokens[same]:
                same += 1
            best = max(best, same)
        return best

"""Per-session server state (committed history + KV cache), bounded by count (LRU) and idle time (TTL)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cachetools

from specmesh.decoding.prompt_lookup import NgramIndex
from specmesh.wire.history import ResyncRequired, TokenHistory
from specmesh.runtime.engine import CachedTokens, ModelEngine


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 64
    idle_ttl_s: float = 600.0
    max_cache_bytes: int | None = None  # KV-cache memory across sessions; least recently used evicted beyond it

    def __post_init__(self) -> None:
        if self.max_cache_bytes is not None and self.max_cache_bytes < 1:
            raise ValueError(f"max_cache_bytes must be >= 1, got {self.max_cache_bytes}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not self.idle_ttl_s > 0:
            raise ValueError(f"idle_ttl_s must be > 0, got {self.idle_ttl_s}")


@dataclass
class Session:
    history: TokenHistory
    sequence: CachedTokens
    # The prompt-lookup index of its history, where a verifier's streamed steps guess the next token (made on first use,
    # kept up to date by NgramIndex.update).
    lookup: NgramIndex | None = None

    @property
    def num_bytes(self) -> int:
        return self.sequence.num_bytes


def kv_sessions(engine: ModelEngine) -> Callable[[], Session]:
    """Session factory for a model-backed worker: each session gets its own cached sequence of `engine`."""
    return lambda: Session(TokenHistory(), engine.new_sequence())


class _ReportingTTLCache(cachetools.TTLCache):
    """A TTLCache that hands each entry it drops by itself (least recently used when full, idle past the TTL) to
    `on_remove(key, value)`."""

    def __init__(self, maxsize: int, ttl: float, on_remove: Callable[[Any, Any], None],
                 timer: Callable[[], float] = time.monotonic) -> None:
        super().__init__(maxsize=maxsize, ttl=ttl, timer=timer)
        self._on_remove = on_remove

    def expire(self, time=None):
        expired = super().expire(time)
        for key, value in expired:
            self._on_remove(key, value)
        return expired

    def popitem(self):
        key, value = super().popitem()  # expired entries first go through expire() above
        self._on_remove(key, value)
        return key, value


class SessionStore:
    """Maps session ids to sessions (anything with a `history` TokenHistory and a `num_bytes` size), made by
    `new_session`. cachetools.TTLCache evicts the least recently used entry when full and drops entries idle longer
    than the TTL; an evicted session is simply rebuilt by the client's resync.

    `on_remove(session_id, session)`, when given, hears of every session that leaves the store: ended, evicted (count
    or memory) or expired. It is called holding the store's lock, so it must be quick and must not use the store."""

    def __init__(self, limits: SessionLimits, new_session: Callable[[], Any],
                 on_remove: Callable[[str, Any], None] | None = None) -> None:
        self._new_session = new_session
        self._max_cache_bytes = limits.max_cache_bytes
        self._on_remove = on_remove
        self._sessions: cachetools.TTLCache = (
            cachetools.TTLCache(maxsize=limits.max_sessions, ttl=limits.idle_ttl_s) if on_remove is None else
            _ReportingTTLCache(limits.max_sessions, limits.idle_ttl_s, on_remove))
        self._lock = threading.Lock()

    def synced(self, session_id: str, base_length: int, base_hash: int, new_tokens: list[int]) -> Session:
        """The session whose history now equals the client's, creating it when the client sends a full history."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                if base_length != 0:
                    raise ResyncRequired(f"unknown session {session_id!r}")
                session = self._new_session()
            self._sessions[session_id] = session  # (re)insert: refreshes both LRU order and TTL
        session.history.apply_sync(base_length, base_hash, new_tokens)
        return session

    def enforce_memory(self) -> None:
        """Evict least recently used sessions while the KV caches together exceed the memory limit (the most recent
        session always stays: it is the one being served)."""
        if self._max_cache_bytes is None:
            return
        with self._lock:
            while len(self._sessions) > 1 and self.cache_bytes_locked() > self._max_cache_bytes:
                self._sessions.popitem()  # TTLCache.popitem removes the least recently used entry

    def cache_bytes_locked(self) -> int:
        return sum(session.num_bytes for session in self._sessions.values())

    @property
    def cache_bytes(self) -> int:
        with self._lock:
            return self.cache_bytes_locked()

    def end(self, session_id: str) -> bool:
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None and self._on_remove is not None:
                self._on_remove(session_id, session)
            return session is not None

    def __len__(self) -> int:
        with self._lock:
            self._sessions.expire()
            return len(self._sessions)


def request_session(sessions: SessionStore, request) -> Session:
    """The session a queued request runs on, synced with the client's history (`base_length`, `base_hash`,
    `new_tokens`): a cost probe's own (`probe_session`, kept out of the store so that it counts as no session and
    evicts none), else the store's. Raises ResyncRequired or ValueError for that request alone."""
    if request.probe_session is not None:
        request.probe_session.history.apply_sync(request.base_length, request.base_hash, request.new_tokens)
        return request.probe_session
    return sessions.synced(request.session_id, request.base_length, request.base_hash, request.new_tokens)

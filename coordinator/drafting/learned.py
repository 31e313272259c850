"""What a coordinator learns about drafting across generations, per draft source, and how it fades.

A generation measures how much slower than the workers' costs its drafted rounds ran (drafter and verifier sharing
cores, contexts longer than the workers' warm-up probes, a draft model catching up on tokens another source drafted).
The next generations start from it, so that a slowdown which rules drafting out costs the probes of one generation,
not of every one. Two rules keep that from locking drafting out for good:

- It belongs to the source that earned it. A draft model's slow rounds never price a suffix drafter's drafts (which
  cost microseconds): each source has its own entry, keyed by the name the caller gives it ("suffix", "model", ...).
- It fades with requests, not only with time. Each later generation that does not measure the source again halves
  what is left of it (a slowdown s counts as 1 + (s - 1) / 2^n after n such generations) and it is forgotten after
  FORGET_AFTER_REQUESTS of them or TTL_S seconds, whichever comes first. A source that drafting was switched off for
  is therefore tried again within a few requests (the probe), and that generation's rounds measure it afresh: a
  bounded cost (the policy stops drafting within MIN_DRAFTED_ROUNDS rounds of a probe that still does not pay).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

TTL_S = 600.0  # the machine's load changes: a measurement older than this says little
FORGET_AFTER_REQUESTS = 6  # generations after which an unconfirmed slowdown is forgotten
FADE_PER_REQUEST = 0.5  # the share of the excess slowdown (s - 1) kept by each generation that did not measure it
MIN_SLOWDOWN, MAX_SLOWDOWN = 0.5, 4.0


@dataclass(frozen=True)
class Learned:
    slowdown: float  # as measured
    measured_at: float  # monotonic seconds
    requests_since: int = 0  # generations started since, that did not measure this source again

    def __post_init__(self) -> None:
        if not MIN_SLOWDOWN <= self.slowdown <= MAX_SLOWDOWN:
            raise ValueError(f"slowdown must be in [{MIN_SLOWDOWN}, {MAX_SLOWDOWN}], got {self.slowdown}")
        if self.requests_since < 0:
            raise ValueError(f"requests_since must be >= 0, got {self.requests_since}")

    def faded(self, now: float) -> float | None:
        """The slowdown a generation starting now assumes; None once forgotten."""
        if self.requests_since >= FORGET_AFTER_REQUESTS or now - self.measured_at >= TTL_S:
            return None
        return 1.0 + (self.slowdown - 1.0) * FADE_PER_REQUEST ** self.requests_since


class SourceLearning:
    """Per draft source: the drafting slowdown the last generation that drafted from it measured, fading with the
    generations since. Thread-safe: `coordinator serve` runs generations concurrently."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._learned: dict[str, Learned] = {}
        self._lock = threading.Lock()

    def start_generation(self) -> dict[str, float]:
        """A generation starts: the slowdowns it assumes, by source (forgotten ones left out); every entry then
        counts this generation as one more that has not measured it (record() resets that)."""
        now = self._clock()
        with self._lock:
            assumed = {source: s for source, entry in self._learned.items() if (s := entry.faded(now)) is not None}
            self._learned = {source: Learned(entry.slowdown, entry.measured_at, entry.requests_since + 1)
                             for source, entry in self._learned.items() if source in assumed}
        return assumed

    def record(self, source: str, slowdown: float) -> None:
        """What a generation measured for `source` (clamped to [MIN_SLOWDOWN, MAX_SLOWDOWN])."""
        with self._lock:
            self._learned[source] = Learned(min(max(slowdown, MIN_SLOWDOWN), MAX_SLOWDOWN), self._clock())

    def get(self, source: str) -> Learned | None:
        with self._lock:
            return self._learned.get(source)

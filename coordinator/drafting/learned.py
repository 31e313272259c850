"""What a coordinator learns about drafting across generations, per draft source, and how it fades.

A generation measures how much more than the workers' costs its drafted rounds took: a suffix drafter's rounds as a
slowdown (a factor: drafter and verifier sharing cores, contexts longer than the workers' warm-up probes), a draft
model's as an overhead in seconds per round (its call, the cores changing hands, catching up on tokens another source
drafted: a fixed cost, which a factor on every draft token would price as if long drafts paid it many times over).
The next generations start from it, so that a cost which rules drafting out costs the probes of one generation, not
of every one. Two rules keep that from locking drafting out for good:

- It belongs to the source that earned it. A draft model's slow rounds never price a suffix drafter's drafts (which
  cost microseconds): each source has its own entry, keyed by the name the caller gives it ("suffix", "model", ...).
- It fades with requests, not only with time. Each later generation that does not measure the source again halves
  what is left of it (a slowdown s counts as 1 + (s - 1) / 2^n after n such generations, an overhead o as o / 2^n:
  each towards its measure's neutral value, `Measure.neutral`) and it is forgotten after
  FORGET_AFTER_REQUESTS of them or TTL_S seconds, whichever comes first. A source that drafting was switched off for
  is therefore tried again within a few requests (the probe), and that generation's rounds measure it afresh: a
  bounded cost (the policy stops drafting within MIN_DRAFTED_ROUNDS rounds of a probe that still does not pay).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

TTL_S = 600.0  # the machine's load changes: a measurement older than this says little
FORGET_AFTER_REQUESTS = 6  # generations after which an unconfirmed measurement is forgotten
FADE_PER_REQUEST = 0.5  # the share of the excess over neutral kept by each generation that did not measure it
MIN_SLOWDOWN, MAX_SLOWDOWN = 0.5, 4.0
MAX_OVERHEAD_S = 10.0  # seconds a round: a bound on a measurement, far past any that lets a draft model pay


@dataclass(frozen=True)
class Measure:
    """What a learned value is: the value meaning "as the workers' costs say" (what it fades towards), and its
    bounds (a measurement is clamped into them)."""

    name: str
    neutral: float
    low: float
    high: float


SLOWDOWN = Measure("slowdown", 1.0, MIN_SLOWDOWN, MAX_SLOWDOWN)  # a factor on a source's round costs
OVERHEAD_S = Measure("overhead", 0.0, 0.0, MAX_OVERHEAD_S)  # seconds each of a source's rounds adds to its costs
# A factor on the prior's price of prefilling a token where a draft model's session opens (coordinator/api.py)
OPENING = Measure("opening", 1.0, 0.01, 10.0)


@dataclass(frozen=True)
class Learned:
    value: float  # as measured
    measured_at: float  # monotonic seconds
    requests_since: int = 0  # generations started since, that did not measure this source again
    measure: Measure = SLOWDOWN

    def __post_init__(self) -> None:
        if not self.measure.low <= self.value <= self.measure.high:
            raise ValueError(f"{self.measure.name} must be in [{self.measure.low}, {self.measure.high}], "
                             f"got {self.value}")
        if self.requests_since < 0:
            raise ValueError(f"requests_since must be >= 0, got {self.requests_since}")

    def faded(self, now: float) -> float | None:
        """The value a generation starting now assumes; None once forgotten."""
        if self.requests_since >= FORGET_AFTER_REQUESTS or now - self.measured_at >= TTL_S:
            return None
        neutral = self.measure.neutral
        return neutral + (self.value - neutral) * FADE_PER_REQUEST ** self.requests_since


class SourceLearning:
    """Per draft source: what the last generation that drafted from it measured (its slowdown or its overhead),
    fading with the generations since. Thread-safe: `coordinator serve` runs generations concurrently."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._learned: dict[str, Learned] = {}
        self._lock = threading.Lock()

    def start_generation(self) -> dict[str, float]:
        """A generation starts: the values it assumes, by source (forgotten ones left out); every entry then counts
        this generation as one more that has not measured it (record() resets that)."""
        now = self._clock()
        with self._lock:
            assumed = {source: s for source, entry in self._learned.items() if (s := entry.faded(now)) is not None}
            self._learned = {source: replace(entry, requests_since=entry.requests_since + 1)
                             for source, entry in self._learned.items() if source in assumed}
        return assumed

    def record(self, source: str, value: float, measure: Measure = SLOWDOWN) -> None:
        """What a generation measured for `source`: a `measure` (clamped to its bounds)."""
        with self._lock:
            self._learned[source] = Learned(min(max(value, measure.low), measure.high), self._clock(),
                                            measure=measure)

    def get(self, source: str) -> Learned | None:
        with self._lock:
            return self._learned.get(source)

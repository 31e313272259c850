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
  what is left of it (a slowdown s counts as 1 + (s - 1) / 2^n after n such generations: towards its measure's
  neutral value, `Measure.neutral`) and it is forgotten after FORGET_AFTER_REQUESTS of them or TTL_S seconds,
  whichever comes first. A source that drafting was switched off for is therefore tried again within a few requests
  (the probe), and that generation's rounds measure it afresh: a bounded cost (the policy stops drafting within
  MIN_DRAFTED_ROUNDS rounds of a probe that still does not pay).
- A draft model's overhead a round is held as measured until it is forgotten (`Measure.fade_per_request` 1): it is
  what the machine and the pair cost (the cores changing hands, the call), not what the text does, and trying the
  model again costs its session's opening (prefilling its window: 0.4-1.2 s on the real pair) and a few rounds before
  they measure it. Halved with each request, a 43 ms overhead let the model in again a few generations later, on
  the real pair (row-invariant ik build, 2-core Zen 4, `coordinator bench`), where its rounds never paid against
  25 ms streamed tokens: those generations opened its session and ran 0.80x (a quote) and 0.85x (prose)
  target-only. Held, the model is tried again once in FORGET_AFTER_REQUESTS + 1 generations.
- What is measured again after it was forgotten for want of measurements is held twice as long the next time
  (`Learned.lapses`: 6, 12, 24, then 48 generations), and as long as at first once it is measured while still
  assumed. A draft model that keeps not paying is tried again ever more rarely: each try costs its generation the
  session's opening and the rounds that measure it (on the real pair, row-invariant ik build, 2-core Zen 4, a YAML
  answer that tried it again in `coordinator bench` ran 0.69x target-only, its opening alone 0.2-0.8 s), one in
  every seven generations on a machine where the model never pays. A source forgotten by its TTL starts afresh: the
  machine may have changed.

It is kept across processes too, where the caller names a file (`store`: the coordinator's, per pair of workers,
coordinator/drafting/learning_store.py): each `coordinator generate` or `coordinator bench` is a process of its own,
and one that starts from nothing prices the draft model at the workers' costs alone until two of its rounds have
measured what they really take. On the real pair (row-invariant ik build, 2-core Zen 4) a first generation's model
rounds took 40-60 ms beyond their price, against 25 ms a streamed token: nine of them cost a prose answer 0.64 s
(11%) over streaming it. Stored, the values keep the same fading (the generations of every process count) and a
longer life, STORED_TTL_S, the age of the workers' cached costs they correct (specmesh/worker/cost_probe.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from specmesh.runtime.atomic_files import write_json_atomically

log = logging.getLogger("specmesh.coordinator")

TTL_S = 600.0  # the machine's load changes: a measurement older than this says little
STORED_TTL_S = 6 * 3600.0  # kept in a file: as long as the workers' cached costs it corrects (COST_CACHE_TTL_S)
FORGET_AFTER_REQUESTS = 6  # generations after which an unconfirmed measurement is forgotten
# A source forgotten for want of measurements and then measured again is held twice as long the next time, up to
# FORGET_AFTER_REQUESTS << MAX_LAPSES generations (48): each time it was tried again, it cost the same.
MAX_LAPSES = 3
FADE_PER_REQUEST = 0.5  # the share of the excess over neutral kept by each generation that did not measure it
MIN_SLOWDOWN, MAX_SLOWDOWN = 0.5, 4.0
MAX_OVERHEAD_S = 10.0  # seconds a round: a bound on a measurement, far past any that lets a draft model pay


@dataclass(frozen=True)
class Measure:
    """What a learned value is: the value meaning "as the workers' costs say" (what it fades towards), its bounds (a
    measurement is clamped into them), and the share of its excess over neutral that each generation not measuring
    it keeps (1: held until forgotten)."""

    name: str
    neutral: float
    low: float
    high: float
    fade_per_request: float = FADE_PER_REQUEST


SLOWDOWN = Measure("slowdown", 1.0, MIN_SLOWDOWN, MAX_SLOWDOWN)  # a factor on a source's round costs
# Seconds each of a source's rounds adds to its costs: held until forgotten (the module's docstring)
OVERHEAD_S = Measure("overhead", 0.0, 0.0, MAX_OVERHEAD_S, fade_per_request=1.0)
# A factor on the prior's price of prefilling a token where a draft model's session opens (coordinator/api.py)
OPENING = Measure("opening", 1.0, 0.01, 10.0)
# A factor on the verifier's one-token step (its probe's v(0)): what a token streamed without drafts took in a
# generation's stretches (HybridDraftSource.streamed_token_s), what the draft model's rounds are weighed against. The
# probe times a pass alone on a quiet machine, at one moment: on the real pair a cached v(0) of 31.8 ms against
# 24-25 ms a streamed token an hour later.
STREAM = Measure("stream", 1.0, 0.25, 4.0)
MEASURES = {measure.name: measure for measure in (SLOWDOWN, OVERHEAD_S, OPENING, STREAM)}


@dataclass(frozen=True)
class Learned:
    value: float  # as measured
    measured_at: float  # the learning's clock: wall-clock seconds by default (a stored entry outlives its process)
    requests_since: int = 0  # generations started since, that did not measure this source again
    measure: Measure = SLOWDOWN
    lapses: int = 0  # times in a row the source was forgotten for want of measurements, then measured again

    def __post_init__(self) -> None:
        if not self.measure.low <= self.value <= self.measure.high:
            raise ValueError(f"{self.measure.name} must be in [{self.measure.low}, {self.measure.high}], "
                             f"got {self.value}")
        if self.requests_since < 0:
            raise ValueError(f"requests_since must be >= 0, got {self.requests_since}")
        if not 0 <= self.lapses <= MAX_LAPSES:
            raise ValueError(f"lapses must be in [0, {MAX_LAPSES}], got {self.lapses}")

    def forget_after(self) -> int:
        """Generations without a measurement after which this is forgotten."""
        return FORGET_AFTER_REQUESTS << self.lapses

    def expired(self, now: float, ttl_s: float = TTL_S) -> bool:
        """Past its age: dropped, and what it lapsed is forgotten too (the machine may have changed since)."""
        return now - self.measured_at >= ttl_s

    def faded(self, now: float, ttl_s: float = TTL_S) -> float | None:
        """The value a generation starting now assumes; None once forgotten."""
        if self.requests_since >= self.forget_after() or self.expired(now, ttl_s):
            return None
        neutral = self.measure.neutral
        return neutral + (self.value - neutral) * self.measure.fade_per_request ** self.requests_since


class SourceLearning:
    """Per draft source: what the last generation that drafted from it measured (its slowdown or its overhead),
    fading with the generations since. Thread-safe: `coordinator serve` runs generations concurrently. `store`: a
    JSON file that keeps it for the next processes (read at the start of every generation, so that processes sharing
    it see each other's measurements: per source, the latest measurement wins; written after every change)."""

    def __init__(self, clock: Callable[[], float] = time.time, store: Path | None = None,
                 ttl_s: float | None = None) -> None:
        self._clock = clock
        self._learned: dict[str, Learned] = {}
        self._lock = threading.Lock()
        self.store = store
        self.ttl_s = ttl_s if ttl_s is not None else STORED_TTL_S if store is not None else TTL_S
        self._store_seen: tuple[int, int, int] | None = None  # the store file as last read or written here

    def start_generation(self) -> dict[str, float]:
        """A generation starts: the values it assumes, by source (forgotten ones left out); every entry assumed then
        counts this generation as one more that has not measured it (record() resets that). An entry forgotten for
        want of measurements is kept until its TTL, unassumed, for what record() makes of it."""
        now = self._clock()
        with self._lock:
            self._merge_stored()
            assumed = {source: s for source, entry in self._learned.items()
                       if (s := entry.faded(now, self.ttl_s)) is not None}
            kept = {source: replace(entry, requests_since=entry.requests_since + 1) if source in assumed else entry
                    for source, entry in self._learned.items() if not entry.expired(now, self.ttl_s)}
            changed = bool(assumed) or len(kept) < len(self._learned)
            self._learned = kept
            if changed:
                self._save()
        return assumed

    def record(self, source: str, value: float, measure: Measure = SLOWDOWN) -> None:
        """What a generation measured for `source`: a `measure` (clamped to its bounds). Measured again after it
        was forgotten for want of measurements (the generations since assumed nothing of it: a draft model held out
        by its overhead is tried again), it is held twice as long as before (`Learned.lapses`); measured while it is
        still assumed, as long as at first."""
        now = self._clock()
        with self._lock:
            old = self._learned.get(source)
            lapsed = old is not None and old.faded(now, self.ttl_s) is None and not old.expired(now, self.ttl_s)
            self._learned[source] = Learned(min(max(value, measure.low), measure.high), now, measure=measure,
                                            lapses=min(old.lapses + 1, MAX_LAPSES) if lapsed else 0)
            self._save()

    def get(self, source: str) -> Learned | None:
        with self._lock:
            return self._learned.get(source)

    def _merge_stored(self) -> None:
        """Take from the store each source measured more recently there (by another process) than here. A store
        that is missing, unreadable or of another format adds nothing: the learning goes on from what it has. A store
        unchanged since this learning last read or wrote it is not read again (`coordinator serve` starts every
        request's generation under the lock)."""
        if self.store is None:
            return
        try:
            signature = _signature(self.store.stat())
        except OSError:  # none yet
            return
        if signature == self._store_seen:
            return
        self._store_seen = signature
        try:
            stored = json.loads(self.store.read_text())["entries"]
            entries = {source: Learned(float(e["value"]), float(e["measured_at"]), int(e["requests_since"]),
                                       MEASURES[e["measure"]], int(e.get("lapses", 0)))
                       for source, e in stored.items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.debug("learned costs in %s not read: %s", self.store, e)
            return
        for source, entry in entries.items():
            mine = self._learned.get(source)
            if mine is None or entry.measured_at > mine.measured_at or (
                    entry.measured_at == mine.measured_at and entry.requests_since > mine.requests_since):
                self._learned[source] = entry

    def _save(self) -> None:
        """Write the entries to the store, atomically (a process reading it meanwhile reads the old file or the new
        one); a failure is logged, never raised: the generation goes on without it."""
        if self.store is None:
            return
        now = self._clock()  # what is past its age is left out: nothing later would read it
        entries = {source: {"value": e.value, "measured_at": e.measured_at, "requests_since": e.requests_since,
                            "measure": e.measure.name, "lapses": e.lapses} for source, e in self._learned.items()
                   if not e.expired(now, self.ttl_s)}
        try:
            written = write_json_atomically(self.store, {"version": 1, "entries": entries})
            self._store_seen = _signature(written)
        except OSError as e:
            log.warning("could not keep the learned costs in %s: %s", self.store, e)


def _signature(status: os.stat_result) -> tuple[int, int, int]:
    """A store file's inode, modification time and size: every write replaces the file (a new inode), so another
    signature says another write."""
    return status.st_ino, status.st_mtime_ns, status.st_size

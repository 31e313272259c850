"""Measuring what a worker's calls cost: the priors the coordinator's draft length policy starts from before it has
timed any round (Info's draft_per_token_s, verify_base_s, verify_per_draft_s, verify_costs).

A worker reports SERVING as soon as its warm-up passes have run: costs cached by an earlier start (cost_cache_key) are
reported from the first Info, and costs that are not are measured afterwards, in the background, while no request is
being served (BackgroundCostProbe). Until then Info reports 0 (not measured), and the coordinator times its own
rounds instead.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from specmesh.runtime import model_thread
from specmesh.runtime.atomic_files import write_json_atomically
from specmesh.runtime.gguf_cache import COST_CACHING_ENGINES, cost_cache_on
from specmesh.worker.machine_load import OthersCpu, probe_turn

log = logging.getLogger(__name__)

PROBE_CONTEXT_LENGTH = 32  # short: the priors describe a call on a short context
PROBE_DRAFTS = 4
# The draft counts a verifier's cost curve is measured at (Info's verify_costs): a pass's cost is far from linear in
# its tokens on CPUs (one row is a matrix-vector product, more a matrix-matrix one), so one slope misprices long drafts.
PROBE_VERIFY_DRAFTS = (0, 1, PROBE_DRAFTS, 8, 16)
PROBE_REPEATS = 3
# A probe call waits until the engine has had no request for this long: requests come first, and a call that follows
# another closely (the next step of a stream, a burst) is not held up by a probe that slipped in between them.
QUIET_BEFORE_PROBE_S = 0.1
# Measuring again costs that are already published (cached by an earlier start, past their age or measured on a busy
# machine): nothing waits for the result, so each call waits for this long without a request, and for a machine on
# which no other process computes, with no budget (BUSY_RETRY_S does not apply: it waits as long as it takes). Between
# two rounds of a generation a worker is idle while the other one works (a verifier while the drafter drafts or opens
# its session: 0.02-1.8 s on the real pair); a probe call there (a verify of 16 drafts, 0.2 s) held up the next round
# and shared the cores with the drafter: on 2 Zen 4 cores, model rounds of 0.6-3.7 s where 0.02-0.3 s was usual, in
# every benchmark run on a verifier whose cached costs were past their age.
QUIET_BEFORE_REMEASURE_S = 2.0
STOP_WAIT_S = 10.0  # how long stopping waits for the probe call in flight (one call: far less on any model served)
# A probe call during which other processes computed (machine_load.OthersCpu) is made again after this pause, for at
# most BUSY_RETRY_S of such calls and pauses in all; past that, the costs are measured on the busy machine (logged,
# cached as disturbed, and not used where costs measured quietly by an earlier start were published).
BUSY_PAUSE_S = 0.5
BUSY_RETRY_S = 20.0
# Before a probe call, other processes' CPU is sampled this long, and while they compute the call waits (within the
# same BUSY_RETRY_S): the other worker of a pair serving a request is not slowed by this one's probe (on 2 cores a
# probe call takes a core the other worker's model step wants). SPECMESH_PROBE_QUIET_SAMPLE_S overrides it; 0: no
# sampling (the tests, on a machine that other test processes share).
QUIET_MACHINE_SAMPLE_S = 0.2


def quiet_machine_sample_s() -> float:
    try:
        return max(float(os.environ.get("SPECMESH_PROBE_QUIET_SAMPLE_S", QUIET_MACHINE_SAMPLE_S)), 0.0)
    except ValueError:
        return QUIET_MACHINE_SAMPLE_S

Key = TypeVar("Key")


def probe_context(vocab_size: int, length: int = PROBE_CONTEXT_LENGTH) -> list[int]:
    """A fixed context of token ids spread over the vocabulary (the same for every worker, so costs compare)."""
    return [(7 * i + 3) % max(vocab_size, 1) for i in range(length)]


def timed(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds fn(*args) took. A probe call times itself where it runs (on the model thread, holding the model), so
    that its wait for the model is not counted."""
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def fastest_runs(probes: Mapping[Key, Callable[[], float]], repeats: int = PROBE_REPEATS) -> dict[Key, float]:
    """The fastest of `repeats` runs of each probe, in the seconds each run reports. The fastest is the run least
    disturbed by whatever else the machine was doing; the probes take turns, so that a disturbance is spread over all
    of them."""
    timings: dict[Key, list[float]] = {key: [] for key in probes}
    for _ in range(repeats):
        for key, run in probes.items():
            timings[key].append(run())
    return {key: min(seconds) for key, seconds in timings.items()}


# ------------------------------------------------------------------------------------------------- the cost cache

# A measurement describes the machine as it was (its load, its clock): measured again after this long.
COST_CACHE_TTL_S = 6 * 3600


def cost_cache_key(role: str, engine) -> dict | None:
    """What a measured cost depends on: the model file, the engine, its build and threads, the CPU. None (measure every start)
    for engines without a model file of their own (transformers: tiny test models, hub ids) or with
    SPECMESH_COST_CACHE=0."""
    import platform

    path = getattr(engine, "path", None)
    if not cost_cache_on() or path is None or engine.engine not in COST_CACHING_ENGINES:
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return {"role": role, "file": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "engine": engine.engine, "threads": getattr(engine, "threads", None), "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)),
            # the build and its kernels (ik: repack on or off; one-row passes or not): a step's cost depends on them
            "build": getattr(engine, "build", ""), "exact": getattr(engine, "exact", True), "version": 1}


def _cache_path(key: dict):
    """A JSON file per key under the specmesh cache."""
    import hashlib
    import json

    from specmesh.runtime.catalog import cache_dir

    return cache_dir() / "costs" / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]}.json"


def _turns_path():
    """The lock file whose turns every worker's probe calls on this machine take (machine_load.probe_turn)."""
    from specmesh.runtime.catalog import cache_dir

    return cache_dir() / "costs" / "probe.lock"


def read_cached_costs(key: dict | None, max_age_s: float | None = None, quiet: bool = False) -> Any | None:
    """The costs measured for `key` within `max_age_s` (default COST_CACHE_TTL_S), as they were written; None when
    there are none (or no key): a restarted worker (after a crash, for failover) reports them from its first Info
    instead of measuring. `quiet`: only costs measured on a quiet machine (not `disturbed`)."""
    import json

    if key is None:
        return None
    try:
        cached = json.loads(_cache_path(key).read_text())
        if quiet and cached.get("disturbed", False):
            return None
        if time.time() - cached["measured_at"] < (COST_CACHE_TTL_S if max_age_s is None else max_age_s):
            return cached["costs"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def write_cached_costs(key: dict | None, costs: Any, disturbed: bool = False) -> None:
    """Keep what was measured for `key` (JSON-able) for the next start; nothing without a key. A failure to write is
    logged, never raised: the worker serves the same without its cache. `disturbed`: measured while other processes
    computed (the next start reports them, and measures again)."""
    if key is None:
        return
    path = _cache_path(key)
    try:  # atomic: a worker starting meanwhile reads the old file or the new one, never half of one
        write_json_atomically(path, {"key": key, "costs": costs, "measured_at": time.time(), "disturbed": disturbed})
    except OSError as e:
        log.warning("could not cache the measured costs in %s: %s", path, e)


# ------------------------------------------------------------------------------------- measuring in the background

class RequestActivity:
    """An engine's requests as far as a background probe cares: how many are queued or running, when the last one
    ended, and how many have arrived in all (so that a probe can tell whether one came while it ran). Each request
    of the engine runs inside `request()`."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._in_flight = 0
        self._quiet_since = time.monotonic()
        self._arrivals = 0

    @contextmanager
    def request(self) -> Iterator[None]:
        with self._changed:
            self._in_flight += 1
            self._arrivals += 1
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                self._quiet_since = time.monotonic()
                self._changed.notify_all()

    @property
    def arrivals(self) -> int:
        with self._changed:
            return self._arrivals

    def wait_until_quiet(self, quiet_s: float, stopped: threading.Event) -> int | None:
        """Block until no request has been queued or running for `quiet_s` seconds; then the arrival count (compare
        it with `arrivals` afterwards). None as soon as `stopped` is set (see wake)."""
        with self._changed:
            while not stopped.is_set():
                remaining = quiet_s - (time.monotonic() - self._quiet_since) if self._in_flight == 0 else None
                if remaining is not None and remaining <= 0:
                    return self._arrivals
                self._changed.wait(remaining)  # None: until a request ends (or wake)
        return None

    def wait_for_arrival(self, seen: int, stopped: threading.Event) -> bool:
        """Block until more than `seen` requests have arrived in all; False as soon as `stopped` is set (see wake)."""
        with self._changed:
            while not stopped.is_set():
                if self._arrivals > seen:
                    return True
                self._changed.wait()
        return False

    def wake(self) -> None:
        """Wake wait_until_quiet to look at its `stopped` event again."""
        with self._changed:
            self._changed.notify_all()


class ProbeStopped(Exception):
    """Raised inside a BackgroundCostProbe's measurement when it is stopped: it ends without publishing anything."""


class BackgroundCostProbe:
    """Measures a worker's costs on a daemon thread, after warm-up, one probe call at a time while the engine is idle;
    then caches them (write_cached_costs) and hands them to `publish`, which makes Info report them.

    `probes`: each key's probe call. A call takes the engine's model lock as a request does, so it never runs
    together with a request, and returns the seconds its timed part took, or None when it only prepared the
    measurement (the first call builds the probe's session) and should be made again. A call runs only once no
    request has been queued or running for QUIET_BEFORE_PROBE_S, and a call during which a request arrived is made
    again later: that request waited for it, and its arrival disturbed the timing. So a request waits for the probe
    at most ONE probe call, the one holding the model when it arrives (then the probe waits for quiet again): a
    verify of up to max(PROBE_VERIFY_DRAFTS) drafts on a PROBE_CONTEXT_LENGTH-token context, or a proposal of
    PROBE_DRAFTS tokens on it; the first call prefills that context instead. Each key runs PROBE_REPEATS times
    (fastest_runs), so a measurement is 1 + PROBE_REPEATS * len(probes) calls, and more only where requests came or
    other processes computed during a call (machine_load: the probes of the workers on one machine take turns, and
    a call that shared the cores is made again, within BUSY_RETRY_S).

    `to_costs` turns {key: seconds} into what is cached and published (JSON-able), `finish` (always called, on the
    thread, at the end) drops what the probe calls kept (their session). stop() ends it promptly: a probe call in
    flight finishes first, nothing is published."""

    def __init__(self, role: str, activity: RequestActivity, probes: Mapping[Key, Callable[[], float | None]],
                 to_costs: Callable[[dict[Key, float]], Any], publish: Callable[[Any], None],
                 cache_key: dict | None, finish: Callable[[], None] = lambda: None,
                 others_cpu: Callable[[], OthersCpu] | None = None, remeasure: bool = False) -> None:
        """`remeasure`: costs cached by an earlier start were published already (past COST_CACHE_TTL_S, or measured
        on a busy machine): measured again on an idle machine only (QUIET_BEFORE_REMEASURE_S), never beside other
        processes' work."""
        self.role = role
        self._remeasure = remeasure
        self.disturbed_calls = 0  # calls kept although other processes computed (the budget for waiting was spent)
        # What other processes did during a probe call (tests give their own).
        self._others_cpu = others_cpu if others_cpu is not None else OthersCpu
        self._busy_s = 0.0  # spent on calls made again because other processes computed, and the pauses after them
        self._warned_busy = False
        self.waited_calls = 0  # calls put off because other processes were computing when they were due
        self.busy_calls = 0  # calls made again because other processes computed
        self._activity = activity
        self._probes = probes
        self._to_costs = to_costs
        self._publish = publish
        self._cache_key = cache_key
        self._finish = finish
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"{role}-cost-probe", daemon=True)

    def start(self) -> "BackgroundCostProbe":
        if not self._remeasure:
            log.info("%s: no cached costs: measuring them in the background while no request is served (Info reports "
                     "none until then)", self.role)
        stop_at_exit(self)
        self.thread.start()
        return self

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Stop measuring: returns once the thread has ended (within one probe call), or after `wait_s`. Not from
        the model thread, whose turn a probe call in flight may be waiting for."""
        self._stopped.set()
        self._activity.wake()
        if wait_s > 0 and self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(wait_s)
            if self.thread.is_alive():
                log.warning("%s: the background cost probe has not stopped within %g s", self.role, wait_s)

    def _run(self) -> None:
        started = time.monotonic()
        try:
            costs = self._to_costs(fastest_runs({key: self._undisturbed(probe) for key, probe in self._probes.items()}))
        except ProbeStopped:
            log.debug("%s: stopped before its costs were measured", self.role)
            return
        except Exception as e:  # a probe that cannot run: the worker serves without costs, as it always could
            log.warning("%s: measuring the costs failed, Info reports none: %s", self.role, e, exc_info=True)
            return
        finally:
            self._finish()
        # Read on a busy machine (a first measurement only: a re-measure waits for quiet): on 2 cores a drafter's
        # cost measured while its verifier served read 33.6 ms a token against 12.0 ms quiet, and once cached it
        # priced the draft model out of every generation for the cache's 6 hours. So it is cached as disturbed: the
        # next start reports it (better than none) and measures again.
        self._publish(costs)
        write_cached_costs(self._cache_key, costs, disturbed=self.disturbed_calls > 0)
        took = time.monotonic() - started
        if self.disturbed_calls:
            log.warning("%s: costs measured in %.1f s on a busy machine (%d calls beside other processes' work): "
                        "used, and measured again at the next start: %s", self.role, took, self.disturbed_calls, costs)
        else:
            log.info("%s: costs measured in the background in %.1f s%s: %s", self.role, took,
                     f" ({self.busy_calls} calls made again: other processes computed)" if self.busy_calls else "",
                     costs)

    def _machine_quiet(self) -> bool:
        """Sample other processes' CPU for quiet_machine_sample_s(): True when they were quiet (or the budget for
        waiting on them, BUSY_RETRY_S shared with the calls made again, is spent); False after a busy sample and a
        pause, when the caller looks again (a request of this worker may have come meanwhile)."""
        sample_s = quiet_machine_sample_s()
        if sample_s <= 0 or self._busy_s >= BUSY_RETRY_S and not self._remeasure:
            return True  # a re-measure has no budget: it waits for quiet (with sampling on)
        with self._others_cpu() as others:
            if self._stopped.wait(sample_s):
                raise ProbeStopped
        if not others.busy:
            return True
        if not self.waited_calls:
            log.info("%s: other processes are computing: its cost probe waits for them (%s)", self.role,
                     "for as long as they do: its costs are reported already" if self._remeasure
                     else f"at most {BUSY_RETRY_S:g} s in all")
        self.waited_calls += 1
        self._busy_s += others.wall_s + BUSY_PAUSE_S
        if self._stopped.wait(BUSY_PAUSE_S):
            raise ProbeStopped
        return False

    def _undisturbed(self, probe: Callable[[], float | None]) -> Callable[[], float]:
        """The probe call as fastest_runs runs it: made (again) until it has measured with no request around, in this
        machine's probe turn (the other workers' probes wait), and with no other process computing meanwhile, as far
        as the BUSY_RETRY_S budget goes (see machine_load)."""
        def run() -> float:
            while True:
                arrivals = self._activity.wait_until_quiet(
                    QUIET_BEFORE_REMEASURE_S if self._remeasure else QUIET_BEFORE_PROBE_S, self._stopped)
                if arrivals is None:
                    raise ProbeStopped
                if not self._machine_quiet():
                    continue
                with probe_turn(_turns_path()), self._others_cpu() as others:
                    seconds = probe()
                if seconds is None or self._activity.arrivals != arrivals:
                    continue
                if not others.busy:
                    return seconds
                # A re-measure never keeps a call made beside other work, where it can see other work coming
                # (sampling on); without sampling it keeps the budget, rather than make calls again forever.
                unbounded = self._remeasure and quiet_machine_sample_s() > 0
                if self._busy_s + others.wall_s + BUSY_PAUSE_S > BUSY_RETRY_S and not unbounded:
                    self.disturbed_calls += 1
                    if not self._warned_busy:
                        log.warning("%s: other processes kept computing while its costs were measured (%.2f CPU s "
                                    "in a %.2f s call): the costs may read high", self.role, others.others_s,
                                    others.wall_s)
                        self._warned_busy = True
                    return seconds
                self._busy_s += others.wall_s + BUSY_PAUSE_S
                self.busy_calls += 1
                if self._stopped.wait(BUSY_PAUSE_S):
                    raise ProbeStopped
        return run


_running: weakref.WeakSet = weakref.WeakSet()  # probes (and idle upkeeps) started, perhaps still running


def stop_at_exit(background) -> None:
    """Have `background` (anything with stop(wait_s)) stopped at the interpreter's exit, as the probes are."""
    _running.add(background)


@atexit.register
def _stop_at_exit() -> None:
    """Stop every probe still measuring (and every idle upkeep) before the interpreter freezes its daemon threads.
    A model thread of its own (tests, embedding) would be frozen in the middle of a probe call, and torch then aborts
    the process ("terminate called without an active exception"): the call in flight finishes first. Where the main
    thread is the model thread (a worker process) its loop has ended by now, and a call still waiting for it never
    runs: nothing to wait for."""
    for probe in list(_running):
        probe.stop(0.0 if model_thread.uses_main_thread() else STOP_WAIT_S)


def costs_now_or_in_background(role: str, loaded, activity: RequestActivity,
                               probes: Mapping[Key, Callable[[], float | None]],
                               to_costs: Callable[[dict[Key, float]], Any], publish: Callable[[Any], None],
                               finish: Callable[[], None] = lambda: None) -> BackgroundCostProbe | None:
    """The end of a warm-up: publish the costs cached for this model, engine and machine at once; else start measuring
    them in the background (returned, to be stopped with the engine). Costs older than COST_CACHE_TTL_S, or measured
    on a busy machine, are published too, and measured again meanwhile: a short-lived worker (`make run` stops its
    workers after one answer, often before a probe ends) still starts from them, rather than from none until some run
    outlives its probe."""
    key = cost_cache_key(role, loaded)
    published = False  # costs cached by an earlier start reported: measured again on an idle machine only
    for max_age_s, quiet in ((COST_CACHE_TTL_S, True), (float("inf"), False)):
        cached = read_cached_costs(key, max_age_s, quiet=quiet)
        if cached is None:
            continue
        try:
            publish(cached)
        except (TypeError, ValueError) as e:  # not what this version writes: measured again, and overwritten
            log.warning("%s: ignoring cached costs %r: %s", role, cached, e)
            break
        if quiet:
            return None
        published = True
        measured_quietly = read_cached_costs(key, max_age_s, quiet=True) is not None
        log.info("%s: reporting costs measured %s while it measures them again (on an idle machine: after %g s "
                 "without a request, with no other process computing)", role,
                 f"over {COST_CACHE_TTL_S / 3600:g} h ago" if measured_quietly else "on a busy machine",
                 QUIET_BEFORE_REMEASURE_S)
        break
    return BackgroundCostProbe(role, activity, probes, to_costs, publish, key, finish, remeasure=published).start()

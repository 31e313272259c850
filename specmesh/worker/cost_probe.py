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
STOP_WAIT_S = 10.0  # how long stopping waits for the probe call in flight (one call: far less on any model served)
# A probe call during which other processes computed (machine_load.OthersCpu) is made again after this pause, for at
# most BUSY_RETRY_S of such calls and pauses in all; past that, the costs are measured on the busy machine (logged).
BUSY_PAUSE_S = 0.5
BUSY_RETRY_S = 20.0

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
    """What a measured cost depends on: the model file, the engine and its threads, the CPU. None (measure every start)
    for engines without a model file of their own (transformers: tiny test models, hub ids) or with
    SPECMESH_COST_CACHE=0."""
    import platform

    path = getattr(engine, "path", None)
    if os.environ.get("SPECMESH_COST_CACHE", "1") == "0" or path is None or engine.engine not in ("ik", "llamacpp"):
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return {"role": role, "file": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "engine": engine.engine, "threads": getattr(engine, "threads", None), "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)), "version": 1}


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


def read_cached_costs(key: dict | None) -> Any | None:
    """The costs measured for `key` within COST_CACHE_TTL_S, as they were written; None when there are none (or no
    key): a restarted worker (after a crash, for failover) reports them from its first Info instead of measuring."""
    import json

    if key is None:
        return None
    try:
        cached = json.loads(_cache_path(key).read_text())
        if time.time() - cached["measured_at"] < COST_CACHE_TTL_S:
            return cached["costs"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def write_cached_costs(key: dict | None, costs: Any) -> None:
    """Keep what was measured for `key` (JSON-able) for the next start; nothing without a key. A failure to write is
    logged, never raised: the worker serves the same without its cache."""
    import json

    if key is None:
        return
    path = _cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "costs": costs, "measured_at": time.time()}))
        tmp.replace(path)  # atomic: a worker starting meanwhile reads the old file or the new one, never half of one
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
                 others_cpu: Callable[[], OthersCpu] | None = None) -> None:
        self.role = role
        # What other processes did during a probe call (tests give their own).
        self._others_cpu = others_cpu if others_cpu is not None else OthersCpu
        self._busy_s = 0.0  # spent on calls made again because other processes computed, and the pauses after them
        self._warned_busy = False
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
        log.info("%s: no cached costs: measuring them in the background while no request is served (Info reports "
                 "none until then)", self.role)
        _running.add(self)
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
        self._publish(costs)
        write_cached_costs(self._cache_key, costs)
        log.info("%s: costs measured in the background in %.1f s%s: %s", self.role, time.monotonic() - started,
                 f" ({self.busy_calls} calls made again: other processes computed)" if self.busy_calls else "", costs)

    def _undisturbed(self, probe: Callable[[], float | None]) -> Callable[[], float]:
        """The probe call as fastest_runs runs it: made (again) until it has measured with no request around, in this
        machine's probe turn (the other workers' probes wait), and with no other process computing meanwhile, as far
        as the BUSY_RETRY_S budget goes (see machine_load)."""
        def run() -> float:
            while True:
                arrivals = self._activity.wait_until_quiet(QUIET_BEFORE_PROBE_S, self._stopped)
                if arrivals is None:
                    raise ProbeStopped
                with probe_turn(_turns_path()), self._others_cpu() as others:
                    seconds = probe()
                if seconds is None or self._activity.arrivals != arrivals:
                    continue
                if not others.busy:
                    return seconds
                if self._busy_s + others.wall_s + BUSY_PAUSE_S > BUSY_RETRY_S:
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


_running: "weakref.WeakSet[BackgroundCostProbe]" = weakref.WeakSet()  # started, perhaps still measuring


@atexit.register
def _stop_at_exit() -> None:
    """Stop every probe still measuring before the interpreter freezes its daemon threads. A model thread of its own
    (tests, embedding) would be frozen in the middle of a probe call, and torch then aborts the process ("terminate
    called without an active exception"): the call in flight finishes first. Where the main thread is the model
    thread (a worker process) its loop has ended by now, and a call still waiting for it never runs: nothing to wait
    for."""
    for probe in list(_running):
        probe.stop(0.0 if model_thread.uses_main_thread() else STOP_WAIT_S)


def costs_now_or_in_background(role: str, loaded, activity: RequestActivity,
                               probes: Mapping[Key, Callable[[], float | None]],
                               to_costs: Callable[[dict[Key, float]], Any], publish: Callable[[Any], None],
                               finish: Callable[[], None] = lambda: None) -> BackgroundCostProbe | None:
    """The end of a warm-up: publish the costs cached for this model, engine and machine at once; else start measuring
    them in the background (returned, to be stopped with the engine)."""
    key = cost_cache_key(role, loaded)
    cached = read_cached_costs(key)
    if cached is not None:
        try:
            publish(cached)
            return None
        except (TypeError, ValueError) as e:  # not what this version writes: measured again, and overwritten
            log.warning("%s: ignoring cached costs %r: %s", role, cached, e)
    return BackgroundCostProbe(role, activity, probes, to_costs, publish, key, finish).start()

"""Measuring what a worker's calls cost, once at warm-up: the priors the coordinator's draft length policy starts
from before it has timed any round (Info's draft_per_token_s, verify_base_s, verify_per_draft_s, verify_costs)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

PROBE_CONTEXT_LENGTH = 32  # short: the priors describe a call on a short context
PROBE_DRAFTS = 4
# The draft counts a verifier's cost curve is measured at (Info's verify_costs): a pass's cost is far from linear in
# its tokens on CPUs (one row is a matrix-vector product, more a matrix-matrix one), so one slope misprices long drafts.
PROBE_VERIFY_DRAFTS = (0, 1, PROBE_DRAFTS, 8, 16)
PROBE_REPEATS = 3

Key = TypeVar("Key")


def probe_context(vocab_size: int, length: int = PROBE_CONTEXT_LENGTH) -> list[int]:
    """A fixed context of token ids spread over the vocabulary (the same for every worker, so costs compare)."""
    return [(7 * i + 3) % max(vocab_size, 1) for i in range(length)]


def fastest_runs(probes: Mapping[Key, Callable[[], object]], repeats: int = PROBE_REPEATS) -> dict[Key, float]:
    """Seconds of each probe's fastest of `repeats` runs. The fastest is the run least disturbed by whatever else the
    machine was doing; the probes take turns, so that a disturbance is spread over all of them."""
    timings: dict[Key, list[float]] = {key: [] for key in probes}
    for _ in range(repeats):
        for key, run in probes.items():
            started = time.perf_counter()
            run()
            timings[key].append(time.perf_counter() - started)
    return {key: min(seconds) for key, seconds in timings.items()}


# A measurement describes the machine as it was (its load, its clock): measured again after this long.
COST_CACHE_TTL_S = 6 * 3600


def cost_cache_key(role: str, engine) -> dict | None:
    """What a measured cost depends on: the model file, the engine and its threads, the CPU. None (measure every start)
    for engines without a model file of their own (transformers: tiny test models, hub ids) or with
    SPECMESH_COST_CACHE=0."""
    import os
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


def cached_costs(key: dict | None, measure: Callable[[], Key]) -> Key:
    """measure() once per key: a restarted worker (after a crash, for failover) reads its costs back instead of
    probing again, and reports SERVING seconds sooner. The cache is a JSON file per key under the specmesh cache."""
    import hashlib
    import json
    import logging

    from specmesh.runtime.catalog import cache_dir

    if key is None:
        return measure()
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir() / "costs" / f"{name}.json"
    try:
        cached = json.loads(path.read_text())
        if time.time() - cached["measured_at"] < COST_CACHE_TTL_S:
            return cached["costs"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "costs": costs, "measured_at": time.time()}))
        tmp.replace(path)
    except OSError as e:
        logging.getLogger(__name__).warning("could not cache the measured costs in %s: %s", path, e)
    return costs

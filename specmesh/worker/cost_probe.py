"""Measuring what a worker's calls cost, once at warm-up: the priors the coordinator's draft length policy starts
from before it has timed any round (Info's draft_per_token_s, verify_base_s, verify_per_draft_s, verify_costs)."""

from __future__ import annotations

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

"""Timing on shared machines: the fastest of a few runs counts."""

from __future__ import annotations

from collections.abc import Callable


def best_of(repeats: int, run: Callable[[], dict]) -> dict:
    """The fastest of `repeats` runs (the outputs are identical: greedy); shared CPUs make single timings noisy."""
    best = None
    for _ in range(repeats):
        r = run()
        if best is None or r["elapsed_s"] < best["elapsed_s"]:
            best = r
    return best

"""Timing on shared machines: the fastest of a few runs counts, and the sides of a comparison take turns."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from specmesh_bench.modes import Mode


@dataclass
class Runner:
    """One side of the benchmark (specmesh, HF, llama.cpp), loaded and warm: `run(prompt, mode)` times one generation
    and returns its row. `info` describes the side for the report (a runner may add to it when it closes)."""

    info: dict
    run: Callable[[dict, Mode], dict]
    prompt_ids: dict = field(default_factory=dict)


def best_of(repeats: int, run: Callable[[], dict]) -> dict:
    """The fastest of `repeats` runs (the outputs are identical: greedy); shared CPUs make single timings noisy."""
    best = None
    for _ in range(repeats):
        r = run()
        if best is None or r["elapsed_s"] < best["elapsed_s"]:
            best = r
    return best


def take_turns(runners: Mapping[str, Runner], modes: list[Mode], prompts: list[dict], repeats: int,
               log: Callable[[dict], None], rotate: bool = True) -> list[dict]:
    """Every mode whose kind has a runner, prompt by prompt. With `rotate`, each prompt starts one mode later in the
    list than the previous one: on a machine whose speed drifts (other tenants, frequency, memory pressure), no side
    always runs first after a change of prompt, and every side is measured across the same stretch of time."""
    selected = [m for m in modes if m.kind in runners]
    rows = []
    for index, prompt in enumerate(prompts):
        shift = index % len(selected) if rotate and selected else 0
        for mode in selected[shift:] + selected[:shift]:
            row = best_of(repeats, lambda mode=mode: runners[mode.kind].run(prompt, mode))
            rows.append(row)
            log(row)
    return rows

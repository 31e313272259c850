"""Hold a loaded model's weights once, in the process's own memory, never in a mapping of the checkpoint file.

transformers memory-maps a safetensors checkpoint; where the requested dtype is the checkpoint's, each parameter is a
view of that mapping, i.e. of the page cache. Running from the mapping would hold less (the embedding rows no token
has used are never read: the 1.5B target 6.13 GiB resident for 6.62 GiB of weights, the 0.5B draft 2.25 GiB for 2.35),
but page cache is reclaimable: under memory pressure, or on machines that page out idle memory proactively (this
one runs a DAMON scheme that drops pages idle for 60 s), a worker idle for a minute would read its weights back from
disk on its next call, seconds of latency. Anonymous memory without swap stays. So every tensor that views a mapping
is copied out once (the mapping, and the pages read while loading, then go) and the weights are held once, in the
process's own memory, where oneDNN reads them in place. A loader that already copied everything (another dtype)
costs nothing here."""

from __future__ import annotations

import bisect
import sys

import torch


def file_mapped_ranges(suffix: str = ".safetensors") -> list[tuple[int, int]]:
    """Sorted (start, end) address ranges of this process's mappings of files ending in `suffix` (Linux)."""
    ranges = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n").endswith(suffix):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return sorted(ranges)


def _inside(ranges: list[tuple[int, int]], address: int) -> bool:
    i = bisect.bisect_right(ranges, (address, sys.maxsize)) - 1
    return i >= 0 and ranges[i][0] <= address < ranges[i][1]


def mapped_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters that are views of a mapped checkpoint file, all parameters); buffers are computed, not loaded."""
    ranges = file_mapped_ranges()
    params = [p for p in model.parameters() if p.numel()]
    return sum(p.device.type == "cpu" and _inside(ranges, p.data_ptr()) for p in params), len(params)


def hold_weights_once(model: torch.nn.Module) -> str:
    """Copy every tensor out of the checkpoint's mapping when any parameter views it. Returns where the weights were:
    "copied" (out of the mapping) or "own" (the loader had copied them all)."""
    mapped, _ = mapped_parameters(model)
    if mapped == 0:
        return "own"
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    return "copied"

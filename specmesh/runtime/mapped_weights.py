"""Hold a loaded model's weights once: either in the memory-mapped checkpoint or in the process's own memory.

transformers memory-maps a safetensors checkpoint. Where the requested dtype is the checkpoint's, each parameter is a
view of that mapping: the weights live in the page cache, counted once in the resident set, and the embedding rows no
token has used are never even read (the 1.5B target: 6.13 GiB resident for 6.62 GiB of weights). Where some
parameters are copies (another dtype, or a checkpoint transformers rearranges), the mapping stays as long as any view
remains and the pages read to make the copies stay resident with it: then every tensor is copied out once, the
mapping goes, and the weights are held once in anonymous memory. Speed is the same either way (measured on the 1.5B
target in float32: one-token steps within run-to-run noise)."""

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
    """Keep the mapping when it holds every parameter; copy every tensor out when it holds only some, so that it
    goes. Returns where the weights live: "mapped", "own" (the loader copied them all) or "copied"."""
    mapped, total = mapped_parameters(model)
    if mapped == total:
        return "mapped" if total else "own"
    if mapped == 0:
        return "own"
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    return "copied"

"""Hold a loaded model's weights once, in the process's own memory, never in a mapping of the checkpoint file.

transformers memory-maps a safetensors checkpoint; where the requested dtype is the checkpoint's, each parameter is a
view of that mapping, i.e. of the page cache. But page cache is reclaimable: under memory pressure, or on machines that
page out idle memory proactively (this one runs a DAMON scheme that drops pages idle for 60 s), a worker idle for a
minute would read its weights back from disk on its next call, seconds of latency for the matrices that every pass
reads in full. So every such tensor is copied out once (the mapping, and the pages read while loading, then go) and
held once, in the process's own memory, where oneDNN reads it in place.

The token embedding is the exception: a pass reads one row of it per token, so it is not copied but read from the
checkpoint file row by row (file_embedding.py), unless the output layer shares it (then every pass reads all of it).
A loader that already copied everything (another dtype) costs nothing here."""

from __future__ import annotations

import bisect
import sys

import torch

from specmesh.runtime.file_embedding import FileBackedEmbedding


def file_mappings(suffix: str = ".safetensors") -> list[tuple[int, int, int, str]]:
    """Sorted (start, end, file offset, path) of this process's mappings of files ending in `suffix` (Linux)."""
    mappings = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].rstrip("\n") if len(fields) == 6 else ""
                if path.endswith(suffix):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    mappings.append((start, end, int(fields[2], 16), path))
    except OSError:
        return []
    return sorted(mappings)


def file_mapped_ranges(suffix: str = ".safetensors") -> list[tuple[int, int]]:
    """Sorted (start, end) address ranges of this process's mappings of files ending in `suffix` (Linux)."""
    return [(start, end) for start, end, _, _ in file_mappings(suffix)]


def mapped_file_at(address: int) -> tuple[str, int] | None:
    """(path, offset in that file) of the mapped checkpoint byte at `address`, or None."""
    for start, end, offset, path in file_mappings():
        if start <= address < end:
            return path, offset + address - start
    return None


def _inside(ranges: list[tuple[int, int]], address: int) -> bool:
    i = bisect.bisect_right(ranges, (address, sys.maxsize)) - 1
    return i >= 0 and ranges[i][0] <= address < ranges[i][1]


def mapped_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters that are views of a mapped checkpoint file, all parameters); buffers are computed, not loaded."""
    ranges = file_mapped_ranges()
    params = [p for p in model.parameters() if p.numel()]
    return sum(p.device.type == "cpu" and _inside(ranges, p.data_ptr()) for p in params), len(params)


def untied_embedding(model: torch.nn.Module) -> torch.nn.Embedding | None:
    """The input embedding, when it is an nn.Embedding no other layer shares (untied: only rows are read)."""
    get_input = getattr(model, "get_input_embeddings", None)
    embedding = get_input() if get_input is not None else None
    if not isinstance(embedding, torch.nn.Embedding):
        return None
    # Every name a parameter is reached by (a tied output layer is the same Parameter under a second name).
    sharing = [p for _, p in model.named_parameters(remove_duplicate=False)
               if p.data_ptr() == embedding.weight.data_ptr()]
    return embedding if len(sharing) == 1 else None


def hold_weights_once(model: torch.nn.Module) -> str:
    """Copy every tensor out of the checkpoint's mapping when any parameter views it, except the untied token
    embedding, which then reads its rows from the file. Returns where the weights were: "copied" (out of the mapping)
    or "own" (the loader had copied them all)."""
    mapped, _ = mapped_parameters(model)
    if mapped == 0:
        return "own"
    embedding = untied_embedding(model)
    source = mapped_file_at(embedding.weight.data_ptr()) if embedding is not None else None
    with torch.no_grad():
        if source is not None and embedding.weight.is_contiguous():
            model.set_input_embeddings(FileBackedEmbedding.of_mapped(embedding.weight, *source))
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    return "copied"

"""A GGUF model requantized to fewer bits, made once with ik_llama.cpp's quantizer and cached.

A drafter need not be exact (its drafts are verified), only fast and mostly right. The default draft model ships with
5-bit blocks and an 8-bit output layer (the largest matrix a step reads); all of it in 4-bit Q4_0, which ik_llama.cpp
repacks into its fastest kernels, steps about 1.6x faster while agreeing with the target nearly as often
(docs/engines.md#a-cheaper-drafter). The copy is made by the `llama-quantize` that the ik-llama-cpp-python wheel
ships (about 2 seconds for the 0.5B model), written beside the other cached models and reused while its source file
is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from pathlib import Path

from specmesh.runtime import catalog
from specmesh.runtime.atomic_files import write_json_atomically

logger = logging.getLogger(__name__)

# Types both engines load (llama.cpp's and ik_llama.cpp's), so a copy serves either. The ik-only types (IQ4_KS, Q6_0,
# ...) are left out: llama.cpp and the gguf package cannot read them.
TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
NONE = "none"  # run the file as it is
AUTO = "auto"  # AUTO_TYPE where the file's weights are wider (auto_type), else the file as it is
AUTO_TYPE = "q4_0"
# Q4_0 stores 4.5 bits a weight; a file above this average has wider weights somewhere worth narrowing.
WIDER_THAN_AUTO_BITS = 4.6


def check_type(quant: str) -> str:
    """`quant` as the quantizer names it ("q4_0" -> "Q4_0"); ValueError naming the choices otherwise."""
    if quant.lower() not in TYPES:
        raise ValueError(f"requantize: unknown type {quant!r}; choose one of {', '.join(TYPES)}, {AUTO} or {NONE}")
    return quant.upper()


def check_choice(choice: str) -> str:
    """A requantize setting: a type, AUTO or NONE (ValueError otherwise)."""
    if choice.lower() not in (AUTO, NONE):
        check_type(choice)
    return choice.lower()


def weight_bits(path: Path) -> float | None:
    """Average bits a weight of the file's matrices take (None where the gguf package cannot read the file, such
    as ik_llama.cpp's own types)."""
    try:
        from gguf import GGUFReader

        matrices = [t for t in GGUFReader(path).tensors if len(t.shape) >= 2]
    except (ImportError, ValueError, OSError):
        return None
    weights = sum(int(t.n_elements) for t in matrices)
    return 8 * sum(int(t.n_bytes) for t in matrices) / weights if weights else None


def auto_type(path: Path) -> str | None:
    """What AUTO runs `path` as: AUTO_TYPE where its weights average wider (the default draft model: 5-bit blocks
    and an 8-bit output layer, 6.2 bits on average), else None (the file as it is: already 4-bit or narrower, or
    unreadable)."""
    bits = cached_weight_bits(path)
    return AUTO_TYPE if bits is not None and bits > WIDER_THAN_AUTO_BITS else None


def cached_weight_bits(path: Path) -> float | None:
    """weight_bits of `path`, read once per source file: the gguf package parses the whole metadata, the tokenizer's
    151k-token arrays included (7 seconds for the default draft model), which a worker should not pay every start."""
    record = cache_path(path, "bits.json")
    try:
        return json.loads(record.read_text())["bits"]
    except (OSError, ValueError, KeyError):
        pass
    bits = weight_bits(path)
    write_json_atomically(record, {"bits": bits})  # a reader sees the whole record or none
    return bits


def quantizer() -> Path:
    """The `llama-quantize` binary of the ik-llama-cpp-python wheel."""
    try:
        from ik_llama_cpp.quantize import find_quantize_bin
    except ImportError:
        raise RuntimeError("requantize needs ik-llama-cpp-python (it ships the quantizer): pip install "
                           "ik-llama-cpp-python, or run the model as it is (--requantize none)") from None
    path = find_quantize_bin()
    if path is None:
        raise RuntimeError("requantize: ik-llama-cpp-python is installed without llama-quantize; run the model as it "
                           "is (--requantize none)")
    return path


def cache_path(source: Path, suffix: str) -> Path:
    """Where what is made from `source` is cached: named by the source's path, size and modification time, so an
    edited or replaced source file gets new ones."""
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return catalog.cache_dir() / "requantized" / f"{source.stem}-{key}-{suffix}"


def requantized(source: Path, quant: str) -> Path:
    """`source` with every weight matrix, the output layer included, in `quant`: the cached copy, made first if
    missing. Concurrent workers wait for one to make it (a file lock); readers see the whole file or none (an atomic
    rename)."""
    kind = check_type(quant)
    target = cache_path(source, f"{kind.lower()}.gguf")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with catalog.file_lock(target.parent / ".requantize.lock"):
        if target.exists():  # made by another worker while this one waited
            return target
        partial = target.with_suffix(f".partial{os.getpid()}")
        command = [str(quantizer()), "--allow-requantize", "--output-tensor-type", kind.lower(),
                   "--token-embedding-type", kind.lower(), str(source), str(partial), kind,
                   str(len(os.sched_getaffinity(0)))]
        logger.info("requantizing %s to %s (once; cached as %s)", source.name, kind, target)
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0 or not partial.exists():
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
                raise RuntimeError(f"requantizing {source} to {kind} failed (exit {done.returncode}): {tail}")
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
    return target

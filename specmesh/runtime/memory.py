"""Handing memory the process no longer uses back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


def return_freed_memory() -> None:
    """Collect garbage, then let glibc give freed heap pages back: loading a model and its tokenizer frees many small
    blocks that would otherwise stay in the process's resident set."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)

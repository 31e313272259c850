"""Where a GGUF model's cached conversions live, and the key that names them, without torch: the coordinator's
tokenizer reads these caches while its local workers load, and importing torch there (a second of CPU) would slow
them (specmesh/runtime/models.py, which converts, re-exports these)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from specmesh.runtime import catalog

# The engines whose workers cache their measured costs, keyed by their GGUF file (specmesh/worker/cost_probe.py); a
# coordinator reads this to know whether a run's measurement outlives its workers (coordinator/cli.py).
COST_CACHING_ENGINES = frozenset({"ik", "llamacpp"})


def cost_cache_on() -> bool:
    """Whether measured costs are cached at all: not with SPECMESH_COST_CACHE=0."""
    return os.environ.get("SPECMESH_COST_CACHE", "1") != "0"


# Written into a conversion's directory before its atomic rename: its presence means the directory is complete.
CONVERTED_MARKER = "specmesh_converted.json"


def converted_dir(label: str, key: str) -> Path:
    """Directory of the cached HF conversion of a GGUF (may not exist yet)."""
    return catalog.cache_dir() / "converted" / f"{label}-{key}"


def is_converted(path: Path) -> bool:
    # The marker is written before the atomic rename, so its presence means
    # the directory is complete.
    return (path / CONVERTED_MARKER).is_file()


def gguf_source(spec: str) -> tuple[Path, str, str] | None:
    """(gguf path, cache label, cache key) for catalog names and .gguf paths."""
    if spec in catalog.CATALOG:
        entry = catalog.CATALOG[spec]
        return catalog.gguf_path(spec), spec, entry.sha256[:16]
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        path = path.resolve()
        st = path.stat()
        # Path+size+mtime instead of hashing: cheap, and a rewritten file
        # gets a new conversion.
        key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
        return path, path.stem, key
    return None

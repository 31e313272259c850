"""Where a coordinator keeps what it learned of its workers across processes (SourceLearning's store,
coordinator/drafting/learned.py): one JSON file per set of workers under the specmesh cache, named by what the learned
values depend on, each worker's model, engine, build and device as its Info reports them. Not the workers' addresses:
`coordinator generate` starts its local workers on new ports every run, and the same workers are what it learned of.

SPECMESH_LEARNING_CACHE=0 keeps learning within each process only; so does SPECMESH_COST_CACHE=0 (the learned values
are corrections to the workers' measured costs, which that variable stops caching)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

LEARNING_CACHE_VARIABLE = "SPECMESH_LEARNING_CACHE"


def learning_cache_on() -> bool:
    from specmesh.runtime.gguf_cache import cost_cache_on

    return os.environ.get(LEARNING_CACHE_VARIABLE, "1") != "0" and cost_cache_on()


def learning_store(*infos) -> Path | None:
    """The file for the workers whose Info answers are `infos` (None entries: roles not in use); None where the cache
    is off."""
    if not learning_cache_on():
        return None
    from specmesh.runtime.catalog import cache_dir

    key = [{field: getattr(info, field, "") for field in ("role", "model_name", "engine", "engine_build", "device")}
           for info in infos if info is not None]
    name = hashlib.sha256(json.dumps({"workers": key, "version": 1}, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "learned" / f"{name}.json"

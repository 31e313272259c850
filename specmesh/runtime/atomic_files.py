"""Writing a small file so that readers never see half of it: the caches the workers and the coordinator share across
processes (the workers' measured costs, a coordinator's learned values, a tokenizer's facts, a fetched model's marker)
are read by processes that may start while another one writes them."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomically(path: Path, text: str) -> os.stat_result:
    """Write `text` to `path` through a temporary file in the same folder, renamed over it: a reader meanwhile reads
    the old file or the new one, never part of one. The temporary name is unique, so two processes or threads
    writing the same path at once each rename a whole file (the last one wins). Returns the written file's status
    (its inode is the path's until the next write), raises OSError (the folder is created first); the temporary
    file is removed on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fchmod(out.fileno(), 0o644)  # mkstemp makes it 0600; a cache is ordinary data
            written = os.fstat(out.fileno())
        os.replace(tmp, path)
        return written
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomically(path: Path, data: Any, indent: int | None = None) -> os.stat_result:
    """`data` as JSON, written as write_text_atomically writes (raises OSError, and TypeError for what JSON cannot
    hold)."""
    return write_text_atomically(path, json.dumps(data, indent=indent) + ("\n" if indent is not None else ""))

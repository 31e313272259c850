"""What a GGUF engine (llama.cpp, ik_llama.cpp) is built from: the GGUF file of a model spec, its tokenizer and
fingerprint, and the weights' type as llama.cpp describes it. Neither runtime's library is needed here, so both
engines (and the benchmarks that drive the libraries directly) share these without importing each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specmesh.runtime import catalog


def gguf_file(spec: str, progress: bool = True) -> Path:
    """The GGUF file of a catalog name (fetched and verified) or a .gguf path."""
    from specmesh.runtime.models import gguf_source

    if spec in catalog.CATALOG:
        catalog.fetch(spec, progress=progress)
    source = gguf_source(spec)
    if source is None:
        raise ValueError(f"the llama.cpp engine runs GGUF files: {spec!r} is neither a catalog name nor a .gguf path")
    return source[0]


def gguf_engine_inputs(runtime: str, spec: str, device: str, dtype: str, threads: int | None,
                       progress: bool) -> tuple[Path, Any, str, str]:
    """What a GGUF engine (llama.cpp, ik_llama.cpp) is built from, its arguments checked: (the GGUF file, the
    tokenizer (loaded on first use: a worker reads only its cached fingerprint, eos id and chat template), its
    fingerprint, the resolved device type)."""
    from specmesh.runtime.devices import resolve_device
    from specmesh.runtime.tokenizer import GgufTokenizer

    if dtype != "auto":
        raise ValueError(f"--dtype {dtype} applies to the transformers engine; {runtime} runs the GGUF's own "
                         "(quantized) weights")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    path = gguf_file(spec, progress)
    tokenizer = GgufTokenizer(spec, progress=progress)
    return path, tokenizer, tokenizer.fingerprint, resolve_device(device).type


def file_type(description: str) -> str:
    """The weights' type from llama.cpp's model description ("qwen2 1.5B Q5_K - Medium" -> "Q5_K_M"; the description
    is architecture, size, file type)."""
    name = " ".join(description.split()[2:])
    for long, short in ((" - Small", "_S"), (" - Medium", "_M"), (" - Large", "_L")):
        name = name.replace(long, short)
    return name.replace(" ", "") or "gguf"

"""Load only the tokenizer of a model spec (the coordinator and the llama.cpp engine need text <-> ids, not the
transformers weights)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from specmesh.runtime import catalog
from specmesh.runtime import models


def tokenizer_dir(label: str, key: str) -> Path:
    """Cache of a GGUF's tokenizer alone, for when the dequantised model is never needed."""
    return catalog.cache_dir() / "converted" / f"{label}-{key}-tokenizer"


def _convert_tokenizer(gguf: Path, out: Path, progress: bool) -> None:
    """Parse the GGUF's tokenizer once (about 20 s for a 150k vocabulary) and save it in seconds-to-load form, with
    the model's config.json (vocabulary width, eos, context length: what an n-gram drafter reports)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with catalog.file_lock(out.parent / f".{out.name}.lock"):
        if (out / "tokenizer_config.json").is_file():
            return
        if progress:
            print(f"specmesh: reading the tokenizer of {gguf.name} (one-off, cached in {out})", file=sys.stderr,
                  flush=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
        try:
            os.chmod(tmp, 0o755)
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
            AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
            if out.exists():
                shutil.rmtree(out)
            os.rename(tmp, out)  # atomic: a reader sees a complete directory or none
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def load_tokenizer(spec: str, progress: bool = True):
    if models.is_tiny_preset(spec):
        return models.tiny_tokenizer(models.TINY_PRESETS[spec])
    if spec in catalog.CATALOG:
        catalog.fetch(spec, progress=progress)
    source = models.gguf_source(spec)
    if source is None:
        return AutoTokenizer.from_pretrained(spec)  # local HF directory or hub id
    gguf, label, key = source
    converted = models.converted_dir(label, key)
    if models.is_converted(converted):  # the transformers engine's full conversion holds the tokenizer too
        return AutoTokenizer.from_pretrained(converted)
    only = tokenizer_dir(label, key)
    if not (only / "tokenizer_config.json").is_file():
        _convert_tokenizer(gguf, only, progress)
    return AutoTokenizer.from_pretrained(only)

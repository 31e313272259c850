"""Load only the tokenizer of a model spec (the coordinator and the GGUF engines need text <-> ids, not the
transformers weights); for a GGUF model, what a worker needs of it (fingerprint, eos id, chat template) without
loading it (GgufTokenizer)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from specmesh.runtime import catalog
from specmesh.runtime.atomic_files import write_json_atomically
from specmesh.runtime.gguf_cache import converted_dir, gguf_source, is_converted
from specmesh.runtime.tiny_presets import TINY_PRESETS, is_tiny_preset


def tokenizer_dir(label: str, key: str) -> Path:
    """Cache of a GGUF's tokenizer alone, for when the dequantised model is never needed."""
    return catalog.cache_dir() / "converted" / f"{label}-{key}-tokenizer"


def _convert_tokenizer(gguf: Path, out: Path, progress: bool) -> None:
    """Parse the GGUF's tokenizer once (about 20 s for a 150k vocabulary) and save it in seconds-to-load form, with
    the model's config.json (vocabulary width, eos, context length: what an n-gram drafter reports)."""
    from transformers import AutoConfig, AutoTokenizer

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
    if is_tiny_preset(spec):
        from specmesh.runtime.models import tiny_tokenizer  # torch: only the tiny presets need it

        return tiny_tokenizer(TINY_PRESETS[spec])
    if spec in catalog.CATALOG:
        catalog.fetch(spec, progress=progress)
    source = gguf_source(spec)
    if source is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec)  # local HF directory or hub id
    gguf, label, key = source
    converted = converted_dir(label, key)
    if is_converted(converted):  # the transformers engine's full conversion holds the tokenizer too
        return load_saved_tokenizer(converted)
    only = tokenizer_dir(label, key)
    if not (only / "tokenizer_config.json").is_file():
        _convert_tokenizer(gguf, only, progress)
    return load_saved_tokenizer(only)


def load_saved_tokenizer(directory: Path):
    """A tokenizer this cache saved, loaded with the class its tokenizer_config.json names: the class AutoTokenizer
    would pick, without AutoTokenizer's import of transformers' model configurations, which imports torch (1.6 s of
    CPU against 2.6 s, on the cores where the coordinator's workers are loading). AutoTokenizer where the class is
    not one this transformers has (a cache saved by another version)."""
    import transformers

    try:
        name = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    try:
        tokenizer_class = getattr(transformers, name) if isinstance(name, str) and name.isidentifier() else None
    except (AttributeError, ImportError):
        tokenizer_class = None
    if tokenizer_class is None or not hasattr(tokenizer_class, "from_pretrained"):
        return transformers.AutoTokenizer.from_pretrained(directory)
    return tokenizer_class.from_pretrained(directory)


class GgufTokenizer:
    """A GGUF model's tokenizer, loaded on first use. Its fingerprint, eos id and chat template, all a worker needs of
    it, come from a small cache file written the first time (loading Qwen's 151k-token tokenizer takes about a second
    of a worker's start, which a restarted worker should not spend)."""

    def __init__(self, spec: str, progress: bool = True) -> None:
        from specmesh.runtime.fingerprint import SCHEME, tokenizer_fingerprint

        self._spec, self._progress, self._loaded = spec, progress, None
        _, label, key = gguf_source(spec)
        path = catalog.cache_dir() / "converted" / f"{label}-{key}-tokenizer-facts.json"
        try:
            facts = json.loads(path.read_text())
            if facts.get("scheme") != SCHEME:
                raise ValueError("another fingerprint scheme")
        except (OSError, ValueError):
            tokenizer = self._load()
            facts = {"scheme": SCHEME, "fingerprint": tokenizer_fingerprint(tokenizer),
                     "eos_token_id": tokenizer.eos_token_id, "chat_template": tokenizer.chat_template}
            write_json_atomically(path, facts)
        self.fingerprint: str = facts["fingerprint"]
        self.eos_token_id: int | None = facts["eos_token_id"]
        self.chat_template: str | None = facts["chat_template"]

    def _load(self):
        if self._loaded is None:
            self._loaded = load_tokenizer(self._spec, progress=self._progress)
        return self._loaded

    def __getattr__(self, name: str):  # anything but the facts: the tokenizer itself
        if name.startswith("__") or name in ("_spec", "_progress", "_loaded"):
            raise AttributeError(name)
        return getattr(self._load(), name)

    def __call__(self, *args, **kwargs):
        return self._load()(*args, **kwargs)

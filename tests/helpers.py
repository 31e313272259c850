"""Shared test helpers: reference decoding straight from the model, without any cache or speculation."""

from __future__ import annotations

import torch


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """The target's own greedy decoding, recomputing the whole sequence every step (no KV cache involved)."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([tokens], device=model.device)).logits[0, -1]
        token = int(torch.argmax(logits))
        out.append(token)
        tokens.append(token)
        if token in eos_ids:
            break
    return out

"""The Hugging Face side of the benchmark: transformers in-process on the same chat-templated prompt ids:
`model.generate()` (hf-target), `model.generate(assistant_model=draft)` (hf-assisted, HF's defaults) and prompt lookup
(hf-ngram), all greedy."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from specmesh_bench.measure import Runner
from specmesh_bench.modes import Mode


class ForwardCounter:
    """Counts forward passes of a model (a target pass = one round of assisted generation; a draft pass = a token)."""

    def __init__(self, model) -> None:
        self.count = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, *_) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


@contextmanager
def hf_runner(args, modes: list[Mode], prompts: list[dict], prompt_ids: dict, eos_ids: list[int]) -> Iterator[Runner]:
    """The models loaded in this process and warmed on the first prompt; None without HF modes.
    HF stops at the same end-of-sequence ids as the coordinator: the verifier's."""
    import torch
    from transformers import GenerationConfig

    from specmesh.runtime.models import load_model

    hf_modes = [m for m in modes if m.kind == "hf"]
    if not hf_modes:
        yield None
        return
    target = load_model(args.target_model, device=args.device, dtype=args.dtype, threads=args.threads,
                        linear_backend=args.linear_backend, progress=False)
    draft = (load_model(args.draft_model, device=args.device, dtype=args.dtype, threads=args.threads,
                        linear_backend=args.linear_backend, progress=False)
             if any(m.drafter == "model" for m in hf_modes) else None)
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]

    def config(max_new: int, mode: Mode) -> GenerationConfig:
        extra = {}
        if mode.drafter == "ngram":
            extra = dict(prompt_lookup_num_tokens=args.hf_prompt_lookup_tokens, max_matching_ngram_size=args.ngram_max)
        return GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=list(eos_ids),
                                pad_token_id=pad, **extra)

    def generate(ids: list[int], max_new: int, mode: Mode) -> tuple[list[int], float, int, int]:
        input_ids = torch.tensor([ids], device=target.model.device)
        counters = [ForwardCounter(target.model)] + ([ForwardCounter(draft.model)] if mode.drafter == "model" else [])
        kwargs = {"assistant_model": draft.model} if mode.drafter == "model" else {}
        if mode.drafter == "model" and draft.fingerprint != target.fingerprint and _vocab(draft) != _vocab(target):
            # A draft model of another family: HF's universal assisted generation, which needs both tokenizers (HF
            # tells the two cases apart by the vocabulary width alone, and refuses the tokenizers when it is equal).
            kwargs.update(tokenizer=tok, assistant_tokenizer=draft.tokenizer)
        try:
            started = time.perf_counter()
            with torch.inference_mode():
                out = target.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                            generation_config=config(max_new, mode), **kwargs)
            elapsed = time.perf_counter() - started
        finally:
            for counter in counters:
                counter.close()
        new = out[0, len(ids):].tolist()
        return new, elapsed, counters[0].count, counters[1].count if len(counters) > 1 else 0

    warm = prompt_ids[prompts[0]["id"]]
    for mode in hf_modes:
        generate(warm, 8, mode)

    def run(prompt: dict, mode: Mode) -> dict:
        new, elapsed, target_passes, draft_passes = generate(prompt_ids[prompt["id"]], args.max_new_tokens, mode)
        # Each target pass commits its accepted drafts plus one token of its own.
        accepted = len(new) - target_passes if mode.drafter else 0
        drafted = draft_passes if mode.drafter == "model" else None
        return {
            "prompt_id": prompt["id"], "class": prompt["class"], "mode": mode.name, "kind": "hf",
            "new_tokens": len(new), "elapsed_s": round(elapsed, 4),
            "tokens_per_s": round(len(new) / elapsed, 3), "rounds": target_passes,
            "drafted_tokens": drafted, "accepted_tokens": accepted if mode.drafter else None,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_accepted_length": round(len(new) / target_passes, 4) if target_passes else None,
            "finish_reason": "eos" if new and new[-1] in eos_ids else "length",
            "token_ids": new, "text": tok.decode(new, skip_special_tokens=True),
        }

    hf_info = {"hf_dtype": str(target.dtype).removeprefix("torch."),
               "transformers_assisted_defaults": {"num_assistant_tokens": 20, "num_assistant_tokens_schedule":
                                                  "constant", "assistant_confidence_threshold": 0.4}
               if draft is not None else None,
               "hf_prompt_lookup_num_tokens": args.hf_prompt_lookup_tokens
               if any(m.drafter == "ngram" for m in hf_modes) else None}
    yield Runner(hf_info, run)  # the models live as long as the runner: drop it to free them


def _vocab(loaded) -> int:
    return loaded.model.config.get_text_config().vocab_size

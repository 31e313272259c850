"""The ik_llama.cpp side of the benchmark (GGUF targets only): ik-target, ik_llama.cpp's own one-token greedy loop in
this process, on the target's GGUF with the ik engine's settings (flash attention off, one context), and the engine's
verify cost curve v(n) measured on the same context."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from specmesh_bench.measure import Runner
from specmesh_bench.modes import Mode

CURVE_POINTS = (1, 2, 3, 5, 9, 17)  # tokens of one decode: a verify of k drafts decodes k + 1


class IkGreedyLoop:
    """Prefill, then one `llama_decode` of one token per step, argmax over the last row: what a user of the C API
    writes (the binding's own `IkLlama.generate` builds its candidate array in a Python loop over the vocabulary,
    a cost no C caller pays, so it is not used as the baseline)."""

    def __init__(self, path, n_ctx: int, threads: int) -> None:
        from specmesh.runtime import ik_binding

        self.lib = ik_binding.bind()
        api = self.api = self.lib.api
        params = api.llama_model_default_params()
        params.use_mmap = False  # read into memory: mapped pages idle between timed runs may be paged out
        self.model = api.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"ik_llama.cpp could not load {path}")
        context = api.llama_context_default_params()
        context.n_ctx = context.n_batch = n_ctx
        context.n_seq_max = 1
        context.n_threads = context.n_threads_batch = threads
        context.flash_attn = False  # as the ik engine runs it
        self.ctx = api.llama_init_from_model(self.model, context)
        self.batch = api.llama_batch_init(n_ctx, 0, 1)
        self.n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model))

    def _decode(self, tokens: list[int], start: int) -> np.ndarray:
        batch = self.batch
        for j, token in enumerate(tokens):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, start + j, 1
            batch.seq_id[j][0] = 0
            batch.logits[j] = j == len(tokens) - 1
        batch.n_tokens = len(tokens)
        if self.api.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(self.api.llama_get_logits_ith(self.ctx, len(tokens) - 1), shape=(self.n_vocab,))

    def generate(self, ids: list[int], max_new: int, eos: set[int]) -> tuple[list[int], float, float]:
        """(new tokens, seconds, seconds to the first token: the prefill in one pass, as a C API user runs it)."""
        self.lib.kv_cache_seq_rm(self.ctx, -1, -1, -1)  # every run pays its prefill
        started = time.perf_counter()
        new = [int(np.argmax(self._decode(list(ids), 0)))]
        first = time.perf_counter() - started
        while new[-1] not in eos and len(new) < max_new:
            new.append(int(np.argmax(self._decode([new[-1]], len(ids) + len(new) - 1))))
        return new, time.perf_counter() - started, first

    def verify_curve(self, prompt: list[int], repeats: int = 5) -> dict[str, float]:
        """v(n): the best time of one decode of n tokens after `prompt`, over the one-token time."""
        self.lib.kv_cache_seq_rm(self.ctx, -1, -1, -1)
        self._decode(list(prompt), 0)
        best = {}
        for n in CURVE_POINTS:
            times = []
            for _ in range(repeats):
                self.lib.kv_cache_seq_rm(self.ctx, 0, len(prompt), -1)
                started = time.perf_counter()
                self._decode(list(range(1000, 1000 + n)), len(prompt))
                times.append(time.perf_counter() - started)
            best[n] = min(times)
        return {"one_token_ms": round(1000 * best[1], 2),
                **{f"v({n})": round(best[n] / best[1], 3) for n in CURVE_POINTS[1:]}}

    def close(self) -> None:
        self.api.llama_batch_free(self.batch)
        self.api.llama_free(self.ctx)
        self.api.llama_free_model(self.model)


@contextmanager
def ik_runner(args, modes: list[Mode], prompts: list[dict], prompt_ids: dict,
              eos_ids: list[int]) -> Iterator[Runner | None]:
    """ik-target on the target's GGUF; None without ik modes. Timed prefill included, stopping at max_new_tokens or
    the verifier's end-of-sequence ids, like every other side."""
    ik_modes = [m for m in modes if m.kind == "ik"]
    if not ik_modes:
        yield None
        return
    from specmesh.runtime import ik_binding
    from specmesh.runtime.gguf_files import gguf_file

    path = gguf_file(args.target_model, progress=False)
    threads = args.threads or len(os.sched_getaffinity(0))
    n_ctx = max(len(ids) for ids in prompt_ids.values()) + args.max_new_tokens + 32
    eos = set(eos_ids)
    loop = IkGreedyLoop(path, n_ctx, threads)
    try:
        warm = prompt_ids[prompts[0]["id"]]
        loop.generate(warm, 8, eos)
        curve = loop.verify_curve(warm)

        def run(prompt: dict, mode: Mode) -> dict:
            new, elapsed, first = loop.generate(prompt_ids[prompt["id"]], args.max_new_tokens, eos)
            return {
                "prompt_id": prompt["id"], "class": prompt["class"], "mode": mode.name, "kind": mode.kind,
                "new_tokens": len(new), "elapsed_s": round(elapsed, 4), "tokens_per_s": round(len(new) / elapsed, 3),
                "rounds": len(new), "drafted_tokens": None, "accepted_tokens": None, "acceptance_rate": None,
                "mean_accepted_length": 1.0, "finish_reason": "eos" if new and new[-1] in eos else "length",
                "token_ids": new, "text": "", "first_token_s": round(first, 4), "first_tokens": 1,
            }

        info = {"ik": {"package": "ik-llama-cpp-python", "version": _version(), "gguf": str(path), "n_ctx": n_ctx,
                       "threads": threads, "flash_attn": False, "system_info": ik_binding.system_info(),
                       "build": ik_binding.build_description(repack=False),  # the loop as a C API user writes it
                       "verify_curve": curve}}
        yield Runner(info, run)
    finally:
        loop.close()
        gc.collect()


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ik-llama-cpp-python")
    except PackageNotFoundError:
        return None

"""The llama.cpp side of the benchmark (GGUF targets only): llama-cpp-python's own greedy loop on the target's GGUF
(llama-target) and its prompt-lookup decoding (llama-lookup)."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from specmesh_bench.measure import Runner
from specmesh_bench.modes import Mode


@contextmanager
def llamacpp_runner(args, modes: list[Mode], prompts: list[dict], prompt_ids: dict,
                    eos_ids: list[int]) -> Iterator[Runner | None]:
    """llama-target: llama-cpp-python's greedy `Llama.generate` on the target's GGUF; llama-lookup: the same with its
    prompt-lookup decoding (draft_model=LlamaPromptLookupDecoding). One `Llama` per mode (prompt lookup needs logits
    for every position: logits_all), all freed when the runner closes; None without llama.cpp modes. The weights are
    read into memory, not mapped: mapped pages idle while the other sides run may be reclaimed (some machines page out
    idle memory within a minute), and would be read back from disk in the next timed run. Each generation starts from
    an empty KV cache (`Llama.generate` would otherwise reuse the previous prompt's prefix) and is timed prefill
    included, like the other modes; it stops at max_new_tokens or at the verifier's end-of-sequence ids (as HF
    does)."""
    llama_modes = [m for m in modes if m.kind == "llamacpp"]
    if not llama_modes:
        yield None
        return
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from specmesh.runtime.gguf_files import gguf_file
    from specmesh.runtime.llamacpp_engine import default_model_params_without_extra_buffers

    path = gguf_file(args.target_model, progress=False)
    threads = args.threads or len(os.sched_getaffinity(0))
    # Room for the longest prompt, its new tokens and one round of drafts past them.
    n_ctx = max(len(ids) for ids in prompt_ids.values()) + args.max_new_tokens + args.hf_prompt_lookup_tokens + 16
    eos = set(eos_ids)
    warm = prompt_ids[prompts[0]["id"]]
    generators = {}
    with ExitStack() as stack:
        for mode in llama_modes:
            draft = (LlamaPromptLookupDecoding(num_pred_tokens=args.hf_prompt_lookup_tokens,
                                               max_ngram_size=args.ngram_max) if mode.drafter == "ngram" else None)
            # flash_attn: Llama's default is off; llama.cpp's own default on CPU (auto) and the specmesh llama.cpp
            # engine run it on, and the two attention kernels round differently (greedy outputs part on near-ties).
            with default_model_params_without_extra_buffers():
                llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                      n_threads_batch=threads, flash_attn=args.llama_flash_attn == "on",
                                      draft_model=draft, use_mmap=False, verbose=False)
            stack.callback(llm.close)  # frees the model and context now (the Python object follows later)
            generators[mode.name] = counted_generator(llm, eos)
            generators[mode.name](warm, 8)
        system_info = llama_cpp.llama_print_system_info().decode(errors="replace")

        def run(prompt: dict, mode: Mode) -> dict:
            generate = generators[mode.name]
            new, elapsed, passes = generate(prompt_ids[prompt["id"]], args.max_new_tokens)
            # Pass 1 is the prompt; each later pass carries the last token plus the drafts, and commits the accepted
            # drafts plus one token of its own. Drafts of the last pass past max_new_tokens count as drafted: the
            # acceptance rate is a lower bound there.
            drafted = sum(n - 1 for n in passes[1:]) if mode.drafter else None
            accepted = len(new) - len(passes) if mode.drafter else None
            return {
                "prompt_id": prompt["id"], "class": prompt["class"], "mode": mode.name, "kind": mode.kind,
                "new_tokens": len(new), "elapsed_s": round(elapsed, 4),
                "tokens_per_s": round(len(new) / elapsed, 3), "rounds": len(passes),
                "drafted_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                "mean_accepted_length": round(len(new) / len(passes), 4) if passes else None,
                "finish_reason": "eos" if new and new[-1] in eos else "length",
                "token_ids": new, "text": generate.llm.detokenize(new).decode("utf-8", errors="replace"),
                "first_token_s": (round(generate.first_token_s, 4) if generate.first_token_s is not None else None),
                "first_tokens": 1,
            }

        info = {"llamacpp": {"version": getattr(llama_cpp, "__version__", None), "gguf": str(path), "n_ctx": n_ctx,
                             "threads": threads, "flash_attn": args.llama_flash_attn == "on",
                             "system_info": system_info, "build": build_flags(llama_cpp),
                             "prompt_lookup": {"num_pred_tokens": args.hf_prompt_lookup_tokens,
                                               "max_ngram_size": args.ngram_max}
                             if any(m.drafter == "ngram" for m in llama_modes) else None}}
        yield Runner(info, run)
        generators.clear()
    gc.collect()


# The ggml build options that decide which kernels a llama-cpp-python build runs (pip builds it from source with the
# flags of CMAKE_ARGS; GGML_NATIVE=ON compiles for the CPU it was built on).
BUILD_OPTIONS = ("GGML_NATIVE", "GGML_AVX2", "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AMX_INT8",
                 "GGML_CPU_REPACK", "GGML_LLAMAFILE", "GGML_OPENMP")


def build_flags(llama_cpp_module) -> dict[str, str] | None:
    """The ggml options llama-cpp-python was built with, from the ggml-config.cmake its install ships beside the
    package (None where it has none)."""
    import re
    from pathlib import Path

    config = Path(llama_cpp_module.__file__).resolve().parents[1] / "lib" / "cmake" / "ggml" / "ggml-config.cmake"
    try:
        text = config.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = dict(re.findall(r'set\((GGML_[A-Z0-9_]+) "([^"]*)"\)', text))
    return {name: found[name] for name in BUILD_OPTIONS if name in found} or None


def counted_generator(llm, eos: set[int]):
    """generate(ids, max_new) -> (new ids, seconds, tokens per target pass) on `llm`, counting its eval calls."""
    evals: list[int] = []  # tokens per Llama.eval call: one target pass each (prompt, then 1 + drafts)
    plain_eval = llm.eval

    def counting_eval(tokens):
        evals.append(len(tokens))
        return plain_eval(tokens)

    llm.eval = counting_eval

    def generate(ids: list[int], max_new: int) -> tuple[list[int], float, list[int]]:
        evals.clear()
        llm.reset()  # no KV prefix reuse from the previous generation: every run pays its prefill
        new: list[int] = []
        generate.first_token_s = None
        started = time.perf_counter()
        tokens = llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                              repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
        try:
            for token in tokens:
                if not new:
                    generate.first_token_s = time.perf_counter() - started  # the prefill and the first token
                new.append(int(token))
                if new[-1] in eos or len(new) >= max_new:
                    break
        finally:
            tokens.close()
        return new, time.perf_counter() - started, list(evals)

    generate.llm = llm
    return generate

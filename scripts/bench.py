"""Side-by-side benchmark: specmesh target-only, speculative (draft model, adaptive or fixed k), n-gram drafting, and
in-process Hugging Face transformers and llama.cpp baselines, on the same prompts, models and dtype, in one run.

Phase 1 starts a verifier, a model drafter and an n-gram drafter (`drafter serve --method ngram`) as local
subprocesses (or uses the given addresses) and, prompt by prompt, runs target-only decoding (k = 0, the baseline) then
every specmesh mode on the SAME workers. Phase 2 stops them, loads the models in-process with specmesh.runtime.models.load_model
and runs `model.generate()` (target-only) and `model.generate(assistant_model=draft)` (HF assisted generation, HF's
defaults) greedily on the same chat-templated prompt ids with the same max_new_tokens (`hf-ngram`:
`prompt_lookup_num_tokens`). Phase 3 (GGUF targets only: catalog names and .gguf paths) loads the target's GGUF with
llama-cpp-python's high-level `Llama` and runs its own greedy loop (`llama-target`) and its prompt-lookup decoding
(`llama-lookup`: LlamaPromptLookupDecoding, --hf-prompt-lookup-tokens and --ngram-max) on the same prompt ids; with a
non-GGUF target (or without llama-cpp-python) these modes are skipped with a note. All decoding is greedy.

The workers run on `--engine` (auto | transformers | llamacpp; `--target-engine` / `--draft-engine` override one side);
the report records the engines asked for, the ones the workers run and the CPU flags of the machine. llama.cpp's
batched evaluation is not bit-identical to its one-token evaluation, so on that engine speculative output may drift
from target-only: the first-divergence column (always against this run's specmesh target-only) is the exactness report.

Per mode: tokens/s, speedup over specmesh target-only (per-prompt ratio of tokens/s, geometric mean), over HF
target-only and over llama.cpp target-only, acceptance rate, mean accepted length (tokens per target pass), rounds, a
per-round breakdown (draft_s and verify_s are the coordinator's wall times of the Propose and Verify calls, RPC
included; rest = everything else: loop, text streaming, session teardown), the first token where the output diverges
from target-only, and the analytic speedup E / (k*c + v(k)) with E = (1 - a^(k+1)) / (1 - a), a = measured acceptance
rate, k = mean draft length, c = draft cost per drafted token and v(k) = verify cost per round, both relative to one
target-only round (steady state: the first round of each generation, which holds the prefill, is left out).

    python scripts/bench.py --classes code,quote --limit-prompts 2 --max-new-tokens 64 --out-dir bench-out
    python scripts/bench.py --modes target-only,adaptive,4,ngram --limit-prompts code=2,prose=1,quote=1

Entry points: main(argv) -> int; or build_parser() / run(args) to embed it (e.g. as a `coordinator bench` command).
Writes JSON, a markdown report and a PNG plot of the speedup per prompt (needs matplotlib) when asked.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from coordinator import Coordinator, GenerationOptions  # noqa: E402
from coordinator.draft_length import expected_tokens_per_round  # noqa: E402
from coordinator.local_workers import LocalWorkerSpec, local_workers  # noqa: E402
from specmesh.runtime import onednn  # noqa: E402
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL  # noqa: E402
from specmesh.wire.limits import DEFAULT_MAX_DRAFT_TOKENS  # noqa: E402
from specmesh.runtime.engine import ENGINES, choose_engine, is_gguf_spec, llamacpp_available  # noqa: E402

DEFAULT_PROMPTS = REPO / "scripts" / "bench_prompts.json"
DEFAULT_MODES = "target-only,adaptive,adaptive-cost,pipelined,4,ngram,hf-assisted,hf-target,llama-target,llama-lookup"
BASELINE = "target-only"
HF_BASELINE = "hf-target"
LLAMA_BASELINE = "llama-target"


# --------------------------------------------------------------------------
# modes and prompts
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    name: str  # as shown in tables
    kind: str  # "specmesh", "hf" or "llamacpp"
    drafter: str | None = None  # specmesh: None (target-only), "model" or "ngram"; hf: "model", "ngram" or None;
    #                             llamacpp: None (llama-target) or "ngram" (llama-lookup)
    k: int | None = None  # specmesh: draft length, None = adaptive
    policy: str = "heuristic"  # specmesh adaptive k: coordinator/draft_length.py
    pipeline: bool = False  # specmesh: draft the next round during this round's verify


def parse_mode(text: str) -> Mode:
    t = text.strip().lower()
    if t in ("0", "target-only", "target"):
        return Mode(BASELINE, "specmesh", None, 0)
    if t == "adaptive":
        return Mode("adaptive", "specmesh", "model", None)
    if t in ("pipelined", "adaptive-pipelined"):
        return Mode("pipelined", "specmesh", "model", None, "heuristic", True)
    if t in ("adaptive-cost", "cost"):
        return Mode("adaptive-cost", "specmesh", "model", None, "cost")
    if t == "ngram-cost":
        return Mode("ngram-cost", "specmesh", "ngram", None, "cost")
    if t.isdigit():
        return Mode(f"k={int(t)}", "specmesh", "model", int(t))
    if t.startswith("k=") and t[2:].isdigit():
        return Mode(f"k={int(t[2:])}", "specmesh", "model", int(t[2:]))
    if t == "ngram":
        return Mode("ngram", "specmesh", "ngram", None)
    if t.startswith(("ngram:", "ngram=", "ngram k=")) and t.rpartition("=" if "=" in t else ":")[2].isdigit():
        k = int(t.rpartition("=" if "=" in t else ":")[2])
        return Mode(f"ngram k={k}", "specmesh", "ngram", k)
    if t in ("hf-target", "hf"):
        return Mode(HF_BASELINE, "hf")
    if t == "hf-assisted":
        return Mode("hf-assisted", "hf", "model")
    if t in ("hf-ngram", "hf-prompt-lookup"):
        return Mode("hf-ngram", "hf", "ngram")
    if t in ("llama-target", "llama", "llamacpp-target", "llamacpp"):
        return Mode(LLAMA_BASELINE, "llamacpp")
    if t in ("llama-lookup", "llama-prompt-lookup", "llamacpp-lookup"):
        return Mode("llama-lookup", "llamacpp", "ngram")
    raise ValueError(f"unknown mode {text!r}: expected target-only|0, adaptive, adaptive-cost, pipelined, K, ngram, ngram-cost, "
                     "ngram:K, hf-target, hf-assisted, hf-ngram, llama-target or llama-lookup")


def parse_modes(text: str) -> list[Mode]:
    modes: list[Mode] = []
    for part in text.split(","):
        if part.strip():
            mode = parse_mode(part)
            if mode.k is not None and mode.kind == "specmesh" and not 0 <= mode.k <= DEFAULT_MAX_DRAFT_TOKENS:
                raise ValueError(f"draft length must be in 0..{DEFAULT_MAX_DRAFT_TOKENS}, got {mode.k}")
            if mode not in modes:
                modes.append(mode)
    if parse_mode(BASELINE) not in modes:  # every speedup is relative to it
        modes.insert(0, parse_mode(BASELINE))
    return modes


def llama_skip_reason(target_model: str) -> str | None:
    """Why the llama.cpp baselines cannot run for this target (None: they can)."""
    if not is_gguf_spec(target_model):
        return (f"the target {target_model!r} is not a GGUF model (a catalog name or a .gguf path); "
                "the llama.cpp baselines run GGUF files only")
    if not llamacpp_available():
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    return None


def drop_unrunnable(modes: list[Mode], target_model: str) -> tuple[list[Mode], dict[str, str]]:
    """(the modes that can run, {skipped mode: reason}): llama.cpp baselines need a GGUF target and llama-cpp-python.
    Skipping is not an error: the default mode list holds them, and most test models are not GGUF."""
    llama = [m for m in modes if m.kind == "llamacpp"]
    reason = llama_skip_reason(target_model) if llama else None
    if reason is None:
        return modes, {}
    return [m for m in modes if m.kind != "llamacpp"], {m.name: reason for m in llama}


def requested_engines(args) -> dict[str, str]:
    """The --engine asked for on each side (--target-engine / --draft-engine override --engine)."""
    return {"target": args.target_engine or args.engine, "draft": args.draft_engine or args.engine}


def resolved_engines(args) -> dict[str, str]:
    """What "auto" resolves to for each side's model (specmesh.runtime.engine.choose_engine, as the workers do)."""
    asked = requested_engines(args)
    return {"target": choose_engine(asked["target"], args.target_model, args.device, args.dtype),
            "draft": choose_engine(asked["draft"], args.draft_model, args.device, args.dtype)}


CPU_FLAG = re.compile(r"avx2|avx512.*|amx.*|avx_vnni.*")


def cpu_features(llama_system_info: str | None = None) -> dict:
    """The vector/matrix extensions this run could use: the CPU's flags (/proc/cpuinfo), the kernels torch picked and,
    when llama.cpp ran, the features its build uses (from llama_print_system_info)."""
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = sorted(f for f in line.split(":", 1)[1].split() if CPU_FLAG.fullmatch(f))
                    break
    except OSError:
        pass
    try:
        import torch

        torch_capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - old torch, no torch: just not reported
        torch_capability = None
    out = {"cpu_flags": flags, "torch_cpu_capability": torch_capability, "cpu_count": os.cpu_count()}
    if llama_system_info:
        out["llamacpp_system_info"] = llama_system_info.strip()
        out["llamacpp_cpu_features"] = [name.lower() for name, on in
                                        re.findall(r"([A-Za-z0-9_]+) = (\d+)", llama_system_info)
                                        if on != "0" and CPU_FLAG.fullmatch(name.lower())]
    return out


def llamacpp_system_info() -> str | None:
    try:
        import llama_cpp

        return llama_cpp.llama_print_system_info().decode(errors="replace")
    except Exception:  # noqa: BLE001 - not installed or too old: not reported
        return None


def load_prompts(path: Path, classes: list[str], limit: str | None, ids: list[str] | None) -> list[dict]:
    prompts = json.loads(path.read_text())["prompts"]
    known = sorted({p["class"] for p in prompts})
    for c in classes:
        if c not in known:
            raise ValueError(f"unknown prompt class {c!r}; {path.name} has {', '.join(known)}")
    if ids:
        missing = set(ids) - {p["id"] for p in prompts}
        if missing:
            raise ValueError(f"unknown prompt ids: {', '.join(sorted(missing))}")
        prompts = [p for p in prompts if p["id"] in ids]
    per_class: dict[str, int] = {}
    if limit:
        if "=" in limit:
            for item in limit.split(","):
                name, _, n = item.partition("=")
                per_class[name.strip()] = int(n)
        else:
            per_class = {c: int(limit) for c in classes}
    selected = []
    for c in classes:
        of_class = [p for p in prompts if p["class"] == c]
        selected += of_class[:per_class[c]] if c in per_class else of_class
    if not selected:
        raise ValueError("no prompts selected")
    return selected


# --------------------------------------------------------------------------
# phase 1: specmesh over gRPC
# --------------------------------------------------------------------------


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def specmesh_row(result, prompt: dict, mode: Mode) -> dict:
    s = result.stats
    steady = result.rounds[1:]  # round 1 carries the prompt's prefill on both workers
    return {
        "prompt_id": prompt["id"], "class": prompt["class"], "mode": mode.name, "kind": mode.kind,
        "new_tokens": s["new_tokens"], "elapsed_s": s["elapsed_s"], "tokens_per_s": s["tokens_per_s"],
        "rounds": s["rounds"], "drafted_tokens": s["drafted_tokens"], "accepted_tokens": s["accepted_tokens"],
        "acceptance_rate": s["acceptance_rate"], "mean_accepted_length": s["mean_accepted_length"],
        "draft_s": s["draft_s"], "verify_s": s["verify_s"],
        "rest_s": round(s["elapsed_s"] - s["draft_s"] - s["verify_s"], 4),
        "first_round": ({"drafted": result.rounds[0].drafted, "draft_s": round(result.rounds[0].draft_s, 4),
                         "verify_s": round(result.rounds[0].verify_s, 4)} if result.rounds else None),
        "steady": {"rounds": len(steady), "drafted": sum(r.drafted for r in steady),
                   "accepted": sum(r.accepted for r in steady),
                   "draft_s": round(sum(r.draft_s for r in steady), 4),
                   "verify_s": round(sum(r.verify_s for r in steady), 4)},
        "degraded_rounds": s["degraded_rounds"], "retries": s["retries"],
        "finish_reason": result.finish_reason, "token_ids": result.token_ids, "text": result.text,
    }


def best_of(repeats: int, run):
    """The fastest of `repeats` runs (the outputs are identical: greedy); shared CPUs make single timings noisy."""
    best = None
    for _ in range(repeats):
        r = run()
        if best is None or r["elapsed_s"] < best["elapsed_s"]:
            best = r
    return best


def run_specmesh(args, modes: list[Mode], prompts: list[dict], log) -> tuple[dict, list[dict], dict]:
    """Returns (info, rows, prompt ids by prompt id)."""
    need_model = any(m.drafter == "model" for m in modes if m.kind == "specmesh")
    need_ngram = any(m.drafter == "ngram" for m in modes if m.kind == "specmesh")
    rows: list[dict] = []
    with ExitStack() as stack:
        common = dict(device=args.device, dtype=args.dtype, threads=args.threads,
                      extra_args=("--linear-backend", args.linear_backend))
        engines = requested_engines(args)
        specs = []
        if not args.verifier:
            specs.append(LocalWorkerSpec("verifier", args.target_model, engine=engines["target"], **common))
        if need_model and not args.drafter:
            specs.append(LocalWorkerSpec("drafter", args.draft_model, engine=engines["draft"], **common))
        addresses = dict(stack.enter_context(local_workers(specs))) if specs else {}
        verifier = args.verifier or addresses["verifier"]
        drafter = args.drafter or addresses.get("drafter")
        ngram_drafter = args.ngram_drafter
        if need_ngram and not ngram_drafter:
            extra = ["--method", "ngram", "--ngram-max", str(args.ngram_max), "--ngram-min", str(args.ngram_min)]
            # The n-gram drafter reads the target's tokenizer only: no weights, nothing on device/dtype.
            spec = LocalWorkerSpec("drafter", args.target_model, "cpu", "auto", extra_args=tuple(extra))
            ngram_drafter = stack.enter_context(local_workers([spec]))["drafter"]

        base = stack.enter_context(Coordinator(verifier=verifier))  # loads the verifier's tokenizer
        tokenizer = base.tokenizer
        coordinators = {None: base}
        if need_model:
            coordinators["model"] = stack.enter_context(Coordinator(verifier=verifier, drafter=drafter,
                                                                    tokenizer=tokenizer))
        if need_ngram:
            coordinators["ngram"] = stack.enter_context(Coordinator(verifier=verifier, drafter=ngram_drafter,
                                                                    tokenizer=tokenizer))
        info = {"target": base.verifier_info.model_name, "dtype": base.verifier_info.dtype,
                "device": base.verifier_info.device, "eos_token_ids": sorted(base.verifier_info.eos_token_ids),
                "draft": coordinators["model"].drafter_info.model_name if need_model else None,
                # What the workers report they run (older workers report nothing: None).
                "verifier_engine": getattr(base.verifier_info, "engine", None) or None,
                "drafter_engine": (getattr(coordinators["model"].drafter_info, "engine", None) or None)
                if need_model else None,
                "draft_dtype": coordinators["model"].drafter_info.dtype if need_model else None,
                "ngram": {"min": args.ngram_min, "max": args.ngram_max} if need_ngram else None}

        prompt_ids = {p["id"]: base.encode_prompt(p["prompt"], chat=not args.no_chat) for p in prompts}
        warm = prompt_ids[prompts[0]["id"]]
        for name, c in coordinators.items():  # warm caches, allocators and channels of every worker
            c.generate(list(warm), GenerationOptions(max_new_tokens=8, draft_tokens=0 if name is None else None))

        for prompt in prompts:
            ids = prompt_ids[prompt["id"]]
            for mode in modes:
                if mode.kind != "specmesh":
                    continue
                c = coordinators[mode.drafter]
                options = GenerationOptions(max_new_tokens=args.max_new_tokens, draft_tokens=mode.k,
                                            draft_policy=mode.policy, pipeline=mode.pipeline)
                row = best_of(args.repeats, lambda: specmesh_row(c.generate(list(ids), options), prompt, mode))
                rows.append(row)
                log(row)
        # Memory after every generation: what the workers hold (resident set vs the weights as loaded).
        info["memory"] = {role: worker_memory(c, role) for role, c in (("verifier", base),
                                                                      ("drafter", coordinators.get("model")))
                          if c is not None}
    return info, rows, prompt_ids


def worker_memory(coordinator: Coordinator, role: str) -> dict:
    pool = coordinator.verifiers if role == "verifier" else coordinator.drafters
    reply = pool.endpoints[0].info()
    return {"resident_bytes": reply.resident_bytes, "weights_bytes": reply.weights_bytes}


# --------------------------------------------------------------------------
# phase 2: Hugging Face transformers in-process
# --------------------------------------------------------------------------


class ForwardCounter:
    """Counts forward passes of a model (a target pass = one round of assisted generation; a draft pass = a token)."""

    def __init__(self, model) -> None:
        self.count = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, *_) -> None:
        self.count += 1

    def close(self) -> None:
        self._handle.remove()


def run_hf(args, modes: list[Mode], prompts: list[dict], prompt_ids: dict, eos_ids: list[int],
           log) -> tuple[dict, list[dict]]:
    import torch
    from transformers import GenerationConfig

    from specmesh.runtime.models import load_model

    hf_modes = [m for m in modes if m.kind == "hf"]
    if not hf_modes:
        return {}, []
    target = load_model(args.target_model, device=args.device, dtype=args.dtype, threads=args.threads,
                        linear_backend=args.linear_backend, progress=False)
    draft = (load_model(args.draft_model, device=args.device, dtype=args.dtype, threads=args.threads,
                        linear_backend=args.linear_backend, progress=False) if any(m.drafter == "model" for m in hf_modes) else None)
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

    rows = []
    for prompt in prompts:
        ids = prompt_ids[prompt["id"]]
        for mode in hf_modes:
            def once(mode=mode, ids=ids, prompt=prompt) -> dict:
                new, elapsed, target_passes, draft_passes = generate(ids, args.max_new_tokens, mode)
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
            row = best_of(args.repeats, once)
            rows.append(row)
            log(row)
    hf_info = {"hf_dtype": str(target.dtype).removeprefix("torch."),
               "transformers_assisted_defaults": {"num_assistant_tokens": 20, "num_assistant_tokens_schedule":
                                                  "constant", "assistant_confidence_threshold": 0.4}
               if draft is not None else None,
               "hf_prompt_lookup_num_tokens": args.hf_prompt_lookup_tokens
               if any(m.drafter == "ngram" for m in hf_modes) else None}
    return hf_info, rows


# --------------------------------------------------------------------------
# phase 3: llama.cpp (llama-cpp-python's own loop) in-process
# --------------------------------------------------------------------------


def run_llamacpp(args, modes: list[Mode], prompts: list[dict], prompt_ids: dict, eos_ids: list[int],
                 log) -> tuple[dict, list[dict]]:
    """llama-target: llama-cpp-python's greedy `Llama.generate` on the target's GGUF; llama-lookup: the same with its
    prompt-lookup decoding (draft_model=LlamaPromptLookupDecoding). One `Llama` per mode (prompt lookup needs logits
    for every position: logits_all), freed after its mode. Each generation starts from an empty KV cache
    (`Llama.generate` would otherwise reuse the previous prompt's prefix) and is timed prefill included, like the
    other modes; it stops at max_new_tokens or at the verifier's end-of-sequence ids (as HF does)."""
    llama_modes = [m for m in modes if m.kind == "llamacpp"]
    if not llama_modes:
        return {}, []
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from specmesh.runtime.llamacpp_engine import gguf_file

    path = gguf_file(args.target_model, progress=False)
    threads = args.threads or len(os.sched_getaffinity(0))
    # Room for the longest prompt, its new tokens and one round of drafts past them.
    n_ctx = max(len(ids) for ids in prompt_ids.values()) + args.max_new_tokens + args.hf_prompt_lookup_tokens + 16
    eos = set(eos_ids)
    rows: list[dict] = []
    system_info = None
    warm = prompt_ids[prompts[0]["id"]]
    for mode in llama_modes:
        draft = (LlamaPromptLookupDecoding(num_pred_tokens=args.hf_prompt_lookup_tokens, max_ngram_size=args.ngram_max)
                 if mode.drafter == "ngram" else None)
        # flash_attn: Llama's default is off; llama.cpp's own default on CPU (auto) and the specmesh llama.cpp
        # engine run it on, and the two attention kernels round differently (greedy outputs part on near-ties).
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                              n_threads_batch=threads, flash_attn=args.llama_flash_attn == "on", draft_model=draft,
                              verbose=False)
        try:
            system_info = system_info or llama_cpp.llama_print_system_info().decode(errors="replace")
            evals: list[int] = []  # tokens per Llama.eval call: one target pass each (prompt, then 1 + drafts)
            plain_eval = llm.eval

            def counting_eval(tokens, _eval=plain_eval, _evals=evals):
                _evals.append(len(tokens))
                return _eval(tokens)

            llm.eval = counting_eval

            def generate(ids: list[int], max_new: int, llm=llm, evals=evals) -> tuple[list[int], float, list[int]]:
                evals.clear()
                llm.reset()  # no KV prefix reuse from the previous generation: every run pays its prefill
                new: list[int] = []
                started = time.perf_counter()
                tokens = llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                                      repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
                try:
                    for token in tokens:
                        new.append(int(token))
                        if new[-1] in eos or len(new) >= max_new:
                            break
                finally:
                    tokens.close()
                return new, time.perf_counter() - started, list(evals)

            generate(warm, 8)
            for prompt in prompts:
                ids = prompt_ids[prompt["id"]]

                def once(mode=mode, ids=ids, prompt=prompt) -> dict:
                    new, elapsed, passes = generate(ids, args.max_new_tokens)
                    # Pass 1 is the prompt; each later pass carries the last token plus the drafts, and commits
                    # the accepted drafts plus one token of its own. Drafts of the last pass past max_new_tokens
                    # count as drafted: the acceptance rate is a lower bound there.
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
                        "token_ids": new,
                        "text": llm.detokenize(new).decode("utf-8", errors="replace"),
                    }

                row = best_of(args.repeats, once)
                rows.append(row)
                log(row)
        finally:
            llm.close()  # frees the model and context now (the Python object follows with its closures)
    del llm
    gc.collect()
    info = {"llamacpp": {"version": getattr(llama_cpp, "__version__", None), "gguf": str(path), "n_ctx": n_ctx,
                         "threads": threads, "flash_attn": args.llama_flash_attn == "on", "system_info": system_info,
                         "prompt_lookup": {"num_pred_tokens": args.hf_prompt_lookup_tokens,
                                           "max_ngram_size": args.ngram_max}
                         if any(m.drafter == "ngram" for m in llama_modes) else None}}
    return info, rows


# --------------------------------------------------------------------------
# analysis
# --------------------------------------------------------------------------


def add_relative(rows: list[dict]) -> None:
    """Per-row speedups (tokens/s ratios on the same prompt) and divergence from specmesh target-only (of this run:
    on the llama.cpp engine, whose batched evaluation is not bit-identical to its one-token evaluation, that is the
    exactness report of every speculative mode)."""
    by_prompt: dict[tuple[str, str], dict] = {(r["prompt_id"], r["mode"]): r for r in rows}
    for r in rows:
        base = by_prompt.get((r["prompt_id"], BASELINE))
        hf = by_prompt.get((r["prompt_id"], HF_BASELINE))
        llama = by_prompt.get((r["prompt_id"], LLAMA_BASELINE))
        r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 4) if base else None
        r["speedup_vs_hf_target"] = round(r["tokens_per_s"] / hf["tokens_per_s"], 4) if hf else None
        r["speedup_vs_llama_target"] = round(r["tokens_per_s"] / llama["tokens_per_s"], 4) if llama else None
        r["diverges_at"] = first_divergence(base["token_ids"], r["token_ids"]) if base else None


def summarize(rows: list[dict], modes: list[Mode], classes: list[str]) -> list[dict]:
    out = []
    for cls in [*classes, "all"]:
        base_sel = [r for r in rows if r["mode"] == BASELINE and (cls == "all" or r["class"] == cls)]
        base_rounds = sum(r["steady"]["rounds"] for r in base_sel)
        # One target-only round (verify call, steady state): the unit of every cost below.
        t_round = sum(r["steady"]["verify_s"] for r in base_sel) / base_rounds if base_rounds else None
        for mode in modes:
            sel = [r for r in rows if r["mode"] == mode.name and (cls == "all" or r["class"] == cls)]
            if not sel:
                continue
            tokens = sum(r["new_tokens"] for r in sel)
            seconds = sum(r["elapsed_s"] for r in sel)
            rounds = sum(r["rounds"] for r in sel)
            drafted = sum(r["drafted_tokens"] or 0 for r in sel)
            accepted = sum(r["accepted_tokens"] or 0 for r in sel)
            speedups = [r["speedup"] for r in sel if r["speedup"]]
            vs_hf = [r["speedup_vs_hf_target"] for r in sel if r["speedup_vs_hf_target"]]
            vs_llama = [r["speedup_vs_llama_target"] for r in sel if r.get("speedup_vs_llama_target")]
            div = [r["diverges_at"] for r in sel if r["diverges_at"] is not None]
            s = {
                "class": cls, "mode": mode.name, "kind": mode.kind, "prompts": len(sel), "new_tokens": tokens,
                "tokens_per_s": round(tokens / seconds, 3) if seconds else None,
                "speedup": round(statistics.geometric_mean(speedups), 4) if speedups else None,
                "speedup_vs_hf_target": round(statistics.geometric_mean(vs_hf), 4) if vs_hf else None,
                "speedup_vs_llama_target": round(statistics.geometric_mean(vs_llama), 4) if vs_llama else None,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                "mean_accepted_length": round(tokens / rounds, 4) if rounds else None,
                "rounds": rounds,
                "diverged_prompts": len(div), "earliest_divergence": min(div) if div else None,
            }
            if mode.kind == "specmesh":
                s["draft_ms_per_round"] = round(1000 * sum(r["draft_s"] for r in sel) / rounds, 2)
                s["verify_ms_per_round"] = round(1000 * sum(r["verify_s"] for r in sel) / rounds, 2)
                s["rest_ms_per_round"] = round(1000 * sum(r["rest_s"] for r in sel) / rounds, 2)
                s["prefill_round_ms"] = round(1000 * statistics.mean(
                    r["first_round"]["draft_s"] + r["first_round"]["verify_s"] for r in sel if r["first_round"]), 2)
                s.update(analytic_bound(sel, t_round, s["acceptance_rate"]))
            out.append(s)
    return out


def analytic_bound(sel: list[dict], t_round: float | None, a: float | None) -> dict:
    steady_rounds = sum(r["steady"]["rounds"] for r in sel)
    steady_drafted = sum(r["steady"]["drafted"] for r in sel)
    if not t_round or not steady_rounds:
        return {}
    v = sum(r["steady"]["verify_s"] for r in sel) / steady_rounds / t_round
    result = {"target_round_ms": round(1000 * t_round, 2), "v_k": round(v, 4)}
    if not steady_drafted or a is None:  # target-only: v(0) ~ 1 by definition
        return result
    k = steady_drafted / steady_rounds
    c = sum(r["steady"]["draft_s"] for r in sel) / steady_drafted / t_round
    e = expected_tokens_per_round(a, k)
    measured_e = sum(r["new_tokens"] for r in sel) / sum(r["rounds"] for r in sel)
    result.update({"k_mean": round(k, 3), "c": round(c, 4), "expected_tokens_per_round": round(e, 4),
                   "bound_speedup": round(e / (k * c + v), 4),
                   # The same cost model with the measured tokens per round: checks the costs apart from a.
                   "cost_model_speedup": round(measured_e / (k * c + v), 4)})
    return result


# --------------------------------------------------------------------------
# reports
# --------------------------------------------------------------------------


def _f(value, fmt: str, missing: str = "–") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _x(value) -> str:
    return "–" if value is None else f"{value:.2f}x"


def markdown(report: dict) -> str:
    info, summary, rows = report["info"], report["summary"], report["rows"]
    config = report["config"]
    draft = info.get("draft") or "(no draft model)"
    lines = [f"**{draft} → {info['target']}**, {info['dtype']} on {info['device']}, "
             f"greedy, ≤ {config['max_new_tokens']} new tokens, {len(report['prompts'])} prompts "
             f"({', '.join(f'{n} {c}' for c, n in report['prompt_counts'].items())}), best of "
             f"{config['repeats']}; n-gram drafter n = {config['ngram_min']}.."
             f"{config['ngram_max']}.", ""]
    lines += header_notes(report)
    has_llama = any(s["mode"] == LLAMA_BASELINE for s in summary)
    lines += ["| class | mode | tokens/s | speedup vs target-only | vs HF target-only | "
              + ("vs llama.cpp target-only | " if has_llama else "")
              + "acceptance rate | mean accepted length | rounds | first divergence |",
              "| --- | --- | ---: | ---: | ---: |" + (" ---: |" if has_llama else "") + " ---: | ---: | ---: | --- |"]
    for s in summary:
        div = f"{s['diverged_prompts']}/{s['prompts']} prompts, earliest token {s['earliest_divergence']}" \
            if s["diverged_prompts"] else "none"
        lines.append(f"| {s['class']} | {s['mode']} | {_f(s['tokens_per_s'], '.2f')} | {_x(s['speedup'])} | "
                     f"{_x(s['speedup_vs_hf_target'])} | "
                     + (f"{_x(s.get('speedup_vs_llama_target'))} | " if has_llama else "")
                     + f"{_f(s['acceptance_rate'], '.1%')} | "
                     f"{_f(s['mean_accepted_length'], '.2f')} | {s['rounds']} | {div} |")
    lines += ["", "Per-round breakdown (ms per round, all rounds; draft/verify = coordinator-side wall time of the "
              "RPC) and the analytic speedup E / (k·c + v(k)) next to the measured one (steady-state rounds):", "",
              "| class | mode | draft ms | verify ms | rest ms | prefill round ms | mean k | a | c | v(k) | "
              "E predicted | E measured | speedup bound | bound with E measured | measured |",
              "| --- | --- |" + " ---: |" * 13]
    for s in summary:
        if s["kind"] != "specmesh":
            continue
        lines.append(
            f"| {s['class']} | {s['mode']} | {_f(s['draft_ms_per_round'], '.1f')} | "
            f"{_f(s['verify_ms_per_round'], '.1f')} | {_f(s['rest_ms_per_round'], '.1f')} | "
            f"{_f(s['prefill_round_ms'], '.0f')} | {_f(s.get('k_mean'), '.2f')} | {_f(s['acceptance_rate'], '.2f')} | "
            f"{_f(s.get('c'), '.3f')} | {_f(s.get('v_k'), '.2f')} | {_f(s.get('expected_tokens_per_round'), '.2f')} | "
            f"{_f(s['mean_accepted_length'], '.2f')} | {_x(s.get('bound_speedup'))} | "
            f"{_x(s.get('cost_model_speedup'))} | "
            f"{_x(s['speedup'])} |")
    modes = [m for m in report["config"]["modes"] if m != BASELINE]
    lines += ["", "Speedup over specmesh target-only per prompt:", "",
              "| prompt | class | " + " | ".join(modes) + " |", "| --- | --- |" + " ---: |" * len(modes)]
    by = {(r["prompt_id"], r["mode"]): r for r in rows}
    for p in report["prompts"]:
        cells = [_x(by[(p["id"], m)]["speedup"]) if (p["id"], m) in by else "–" for m in modes]
        lines.append(f"| {p['id']} | {p['class']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def header_notes(report: dict) -> list[str]:
    """Engines, CPU flags, the llama.cpp baselines' settings and skipped modes: the lines under the title."""
    info, config = report["info"], report["config"]
    lines = []
    asked, resolved = config.get("engines"), config.get("resolved_engines")
    if asked or info.get("verifier_engine"):
        ran = f"verifier {info.get('verifier_engine') or (resolved or {}).get('target') or '?'}"
        if info.get("draft"):
            ran += f", drafter {info.get('drafter_engine') or (resolved or {}).get('draft') or '?'}"
            if info.get("draft_dtype") and info.get("draft_dtype") != info.get("dtype"):
                ran += f" ({info['draft_dtype']})"
        lines.append(f"- engines: {ran}" + (f" (asked: --target-engine {asked['target']}, --draft-engine "
                                            f"{asked['draft']})" if asked else "") + ".")
        if "llamacpp" in (info.get("verifier_engine"), info.get("drafter_engine")):
            lines.append("- llama.cpp's batched evaluation is not bit-identical to its one-token evaluation: the first "
                         "divergence column (against this run's target-only) is the exactness report.")
    cpu = info.get("cpu")
    if cpu:
        text = f"- CPU: {cpu.get('cpu_count')} cores, flags {' '.join(cpu.get('cpu_flags') or []) or '(none)'}"
        if cpu.get("torch_cpu_capability"):
            text += f"; torch kernels {cpu['torch_cpu_capability']}"
        if cpu.get("llamacpp_cpu_features") is not None:
            text += f"; llama.cpp build {' '.join(cpu['llamacpp_cpu_features']) or '(none of these)'}"
        lines.append(text + (f"; threads {config['threads']}" if config.get("threads") else "") + ".")
    for role, memory in (info.get("memory") or {}).items():
        if memory.get("weights_bytes"):
            lines.append(f"- {role} memory after the run: {memory['resident_bytes'] / 2**30:.2f} GiB resident, weights "
                         f"{memory['weights_bytes'] / 2**30:.2f} GiB "
                         f"({memory['resident_bytes'] / memory['weights_bytes']:.2f}x).")
    if info.get("hf_dtype"):
        lines.append(f"- HF transformers baselines: {info['hf_dtype']}.")
    llama = info.get("llamacpp")
    if llama:
        lookup = llama.get("prompt_lookup")
        lines.append(f"- llama.cpp baselines: llama-cpp-python {llama.get('version')}, {llama.get('threads')} "
                     f"threads, flash attention {'on' if llama.get('flash_attn') else 'off'}, "
                     f"{Path(llama.get('gguf') or '').name}"
                     + (f"; llama-lookup: num_pred_tokens {lookup['num_pred_tokens']}, max_ngram_size "
                        f"{lookup['max_ngram_size']}" if lookup else "") + ".")
    for mode, reason in (report.get("skipped_modes") or {}).items():
        lines.append(f"- skipped {mode}: {reason}.")
    return lines + [""] if lines else []


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    modes = [m for m in report["config"]["modes"] if m != BASELINE]
    prompts = report["prompts"]
    by = {(r["prompt_id"], r["mode"]): r for r in report["rows"]}
    width = 0.8 / max(len(modes), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(prompts) * max(1, len(modes)) * 0.35 + 2), 4.5))
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(prompts))]
        ys = [(by.get((p["id"], mode)) or {}).get("speedup") or 0.0 for p in prompts]
        ax.bar(xs, ys, width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(prompts)))
    ax.set_xticklabels([p["id"] for p in prompts], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("speedup over specmesh target-only (tokens/s ratio)")
    info = report["info"]
    ax.set_title(f"{info.get('draft') or ''} → {info['target']} ({info['dtype']}, {info['device']}), "
                 f"{report['config']['max_new_tokens']} new tokens", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", help="use this running verifier (default: start one)")
    parser.add_argument("--drafter", help="use this running model drafter (default: start one)")
    parser.add_argument("--ngram-drafter", help="use this running `drafter serve --method ngram` (default: start one)")
    parser.add_argument("--target-model", default=DEFAULT_TARGET_MODEL)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="worker engine, both sides (auto: llama.cpp for GGUF/catalog models on CPU with --dtype "
                        "auto, else transformers)")
    parser.add_argument("--target-engine", choices=ENGINES, default=None, help="verifier engine (default: --engine)")
    parser.add_argument("--draft-engine", choices=ENGINES, default=None,
                        help="model drafter engine (default: --engine)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads: workers, HF and llama.cpp baselines alike (default: all cores)")
    parser.add_argument("--linear-backend", choices=onednn.BACKENDS, default="auto",
                        help="CPU linear kernels, workers and HF alike (specmesh/runtime/onednn.py; default: auto)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help="comma list of target-only (or 0), adaptive, adaptive-cost, pipelined, K (fixed draft length), ngram, ngram-cost, ngram:K, "
                        f"hf-target, hf-assisted, hf-ngram, llama-target, llama-lookup (these two: GGUF targets only, skipped "
                        f"otherwise); target-only is always run (default: {DEFAULT_MODES})")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="prompt set (JSON)")
    parser.add_argument("--classes", default="code,prose,quote", help="prompt classes to run (default: all)")
    parser.add_argument("--limit-prompts", default=None,
                        help="N (first N of every class) or per class, e.g. code=2,prose=1,quote=1")
    parser.add_argument("--prompt-ids", default=None, help="comma list of prompt ids to run")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--repeats", type=int, default=1, help="runs per prompt and mode; the fastest counts")
    parser.add_argument("--ngram-min", type=int, default=1, help="n-gram drafter: shortest n-gram matched")
    parser.add_argument("--ngram-max", type=int, default=3,
                        help="n-gram drafter (and hf-ngram, llama-lookup): longest n-gram")
    parser.add_argument("--hf-prompt-lookup-tokens", type=int, default=10,
                        help="hf-ngram: prompt_lookup_num_tokens, llama-lookup: num_pred_tokens (default: 10, HF's "
                        "documented example and llama-cpp-python's default)")
    parser.add_argument("--llama-flash-attn", choices=("on", "off"), default="on",
                        help="llama-target/llama-lookup: flash attention (default: on, as llama.cpp's auto and the "
                        "specmesh llama.cpp engine run on CPU; llama-cpp-python's Llama defaults to off)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="run nothing: re-render the reports (markdown, plot) of an earlier run's JSON")
    parser.add_argument("--out-dir", type=Path, default=None, help="write bench.json, bench.md and bench.png here")
    parser.add_argument("--json", dest="json_path", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the markdown report here")
    parser.add_argument("--plot", type=Path, default=None, help="write the PNG plot here")


def rerender(args: argparse.Namespace) -> int:
    report = json.loads(args.from_json.read_text())
    modes = parse_modes(",".join(report["config"]["modes"]))
    add_relative(report["rows"])
    report["summary"] = summarize(report["rows"], modes, report["config"]["classes"])
    write_reports(args, report)
    return 0


def write_reports(args: argparse.Namespace, report: dict) -> None:
    text = markdown(report)
    print("\n" + text)
    if args.json_path:
        args.json_path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    if args.plot and plot(report, args.plot):
        print(f"plot: {args.plot}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        args.json_path = args.json_path or args.out_dir / "bench.json"
        args.markdown = args.markdown or args.out_dir / "bench.md"
        args.plot = args.plot or args.out_dir / "bench.png"
    if args.from_json:
        return rerender(args)
    try:
        modes = parse_modes(args.modes)
        classes = [c.strip() for c in args.classes.split(",") if c.strip()]
        prompts = load_prompts(args.prompts, classes, args.limit_prompts,
                               [i.strip() for i in args.prompt_ids.split(",")] if args.prompt_ids else None)
        if args.max_new_tokens < 1 or args.repeats < 1:
            raise ValueError("--max-new-tokens and --repeats must be >= 1")
        engines, resolved = requested_engines(args), resolved_engines(args)
    except (ValueError, OSError) as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    modes, skipped = drop_unrunnable(modes, args.target_model)
    if skipped:
        print(f"bench: note: skipping {', '.join(skipped)}: {next(iter(skipped.values()))}", file=sys.stderr)

    def log(row: dict) -> None:
        acc = row.get("acceptance_rate")
        print(f"{row['class']:5s} {row['mode']:>12s} {row['tokens_per_s']:7.2f} tok/s {row['new_tokens']:4d} tok "
              f"{row['rounds']:4d} rounds  accept {'–' if acc is None else f'{acc:.0%}':>4s}  | {row['prompt_id']}",
              file=sys.stderr, flush=True)

    started = time.time()
    info, rows, prompt_ids = run_specmesh(args, modes, prompts, log)
    # HF stops at the same end-of-sequence ids as the coordinator: the verifier's.
    hf_info, hf_rows = run_hf(args, modes, prompts, prompt_ids, info["eos_token_ids"], log)
    rows += hf_rows
    gc.collect()  # the HF models: gone before llama.cpp loads
    llama_info, llama_rows = run_llamacpp(args, modes, prompts, prompt_ids, info["eos_token_ids"], log)
    rows += llama_rows
    add_relative(rows)
    summary = summarize(rows, modes, classes)
    uses_llamacpp = bool(llama_rows) or "llamacpp" in (info.get("verifier_engine"), info.get("drafter_engine"))
    system_info = ((llama_info.get("llamacpp") or {}).get("system_info") or llamacpp_system_info()
                   if uses_llamacpp else None)
    report = {
        "info": {**info, **hf_info, **llama_info, "cpu": cpu_features(system_info)},
        "config": {"max_new_tokens": args.max_new_tokens, "modes": [m.name for m in modes], "classes": classes,
                   "repeats": args.repeats, "ngram_min": args.ngram_min, "ngram_max": args.ngram_max,
                   "threads": args.threads, "linear_backend": args.linear_backend,
                   "engines": engines, "resolved_engines": resolved,
                   "hf_prompt_lookup_tokens": args.hf_prompt_lookup_tokens,
                   "chat": not args.no_chat, "wall_s": round(time.time() - started, 1)},
        "skipped_modes": skipped,
        "prompts": [{**p, "prompt_tokens": len(prompt_ids[p["id"]])} for p in prompts],
        "prompt_counts": {c: sum(p["class"] == c for p in prompts) for c in classes},
        "summary": summary,
        "rows": rows,
    }
    write_reports(args, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""The specmesh side of the benchmark: every specmesh mode over gRPC on the same workers (started here as local
subprocesses, or the given addresses)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from coordinator import Coordinator, GenerationOptions
from specmesh_bench.engines import requested_engines
from specmesh_bench.measure import Runner
from specmesh_bench.modes import Mode
from coordinator.fleet.local_workers import LocalWorkerSpec, local_workers


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
        # Time to the first round's tokens (prefill included) and how many it committed: the rest is the decode rate.
        "first_token_s": (round(result.rounds[0].draft_s + result.rounds[0].verify_s, 4) if result.rounds else None),
        "first_tokens": (result.rounds[0].accepted + 1) if result.rounds else None,
        "steady": {"rounds": len(steady), "drafted": sum(r.drafted for r in steady),
                   "accepted": sum(r.accepted for r in steady),
                   "draft_s": round(sum(r.draft_s for r in steady), 4),
                   "verify_s": round(sum(r.verify_s for r in steady), 4)},
        "degraded_rounds": s["degraded_rounds"], "retries": s["retries"],
        "draft_decision": s.get("draft_decision", ""),  # what the draft-length policy decided before the first round
        "finish_reason": result.finish_reason, "token_ids": result.token_ids, "text": result.text,
    }


@contextmanager
def specmesh_runner(args, modes: list[Mode], prompts: list[dict]) -> Iterator[Runner]:
    """Workers up and warm, every coordinator connected; the runner's info gains the workers' memory at the end (after
    every generation). Its prompt_ids are the chat-templated prompts every side of the benchmark runs."""
    need_hybrid = any(m.drafter == "hybrid" for m in modes if m.kind == "specmesh")
    need_model = need_hybrid or any(m.drafter == "model" for m in modes if m.kind == "specmesh")
    need_ngram = any(m.drafter == "ngram" for m in modes if m.kind == "specmesh")
    need_suffix = any(m.drafter == "suffix" for m in modes if m.kind == "specmesh")
    with ExitStack() as stack:
        # No prefix cache: every mode of a prompt would otherwise find the prompt cached by the mode before it, a
        # saving the in-process baselines never get (multi-turn workloads measure the cache on its own).
        common = dict(device=args.device, dtype=args.dtype, threads=args.threads,
                      extra_args=("--linear-backend", args.linear_backend, "--no-prefix-cache"))
        engines = requested_engines(args)
        specs = []
        if not args.verifier:
            specs.append(LocalWorkerSpec("verifier", args.target_model, engine=engines["target"], **common))
        if need_model and not args.drafter:
            specs.append(LocalWorkerSpec("drafter", args.draft_model, engine=engines["draft"],
                                         **{**common, "extra_args": (*common["extra_args"], "--requantize",
                                                                     getattr(args, "draft_requantize", "auto"))}))
        # one at a time: each worker's cost probe (the cost policy's prior, measured once it is SERVING) runs on a
        # quiet machine, and the coordinators below start from the measured costs
        addresses = dict(stack.enter_context(local_workers(specs, one_at_a_time=True))) if specs else {}
        verifier = args.verifier or addresses["verifier"]
        drafter = args.drafter or addresses.get("drafter")
        ngram_drafter = args.ngram_drafter
        if need_ngram and not ngram_drafter:
            extra = ["--method", "ngram", "--ngram-max", str(args.ngram_max), "--ngram-min", str(args.ngram_min)]
            # The n-gram drafter reads the target's tokenizer only: no weights, nothing on device/dtype.
            spec = LocalWorkerSpec("drafter", args.target_model, "cpu", "auto", extra_args=tuple(extra))
            ngram_drafter = stack.enter_context(local_workers([spec]))["drafter"]
        # Model-free too, and one per mode that uses one: its trees learn from every generation of that mode, and a
        # shared one would hand the hybrid the suffix mode's answer to the same prompt.
        suffix_spec = LocalWorkerSpec("drafter", args.target_model, "cpu", "auto", extra_args=("--method", "suffix"))
        suffix_drafter = stack.enter_context(local_workers([suffix_spec]))["drafter"] if need_suffix else None
        hybrids = sorted({m.coordinator for m in modes if m.kind == "specmesh" and m.drafter == "hybrid"})
        hybrid_suffix_drafters = {name: stack.enter_context(local_workers([suffix_spec]))["drafter"]
                                  for name in hybrids}

        base = stack.enter_context(Coordinator(verifier=verifier))  # loads the verifier's tokenizer
        tokenizer = base.tokenizer
        coordinators = {None: base}
        if need_model:
            coordinators["model"] = stack.enter_context(Coordinator(verifier=verifier, drafter=drafter,
                                                                    tokenizer=tokenizer))
        if need_ngram:
            coordinators["ngram"] = stack.enter_context(Coordinator(verifier=verifier, drafter=ngram_drafter,
                                                                    tokenizer=tokenizer))
        if need_suffix:
            coordinators["suffix"] = stack.enter_context(Coordinator(verifier=verifier, drafter=suffix_drafter,
                                                                     tokenizer=tokenizer))
        for name, hybrid_suffix_drafter in hybrid_suffix_drafters.items():
            coordinators[name] = stack.enter_context(Coordinator(verifier=verifier, drafter=drafter,
                                                                 suffix_drafter=hybrid_suffix_drafter,
                                                                 tokenizer=tokenizer))
        info = {"target": base.verifier_info.model_name, "dtype": base.verifier_info.dtype,
                "device": base.verifier_info.device, "eos_token_ids": sorted(base.verifier_info.eos_token_ids),
                "draft": coordinators["model"].drafter_info.model_name if need_model else None,
                # What the workers report they run (older workers report nothing: None).
                "verifier_engine": getattr(base.verifier_info, "engine", None) or None,
                "drafter_engine": (getattr(coordinators["model"].drafter_info, "engine", None) or None)
                if need_model else None,
                # Which build each runs and how (ik: package, vector extensions, repack), "" / None: unsaid.
                "verifier_engine_build": getattr(base.verifier_info, "engine_build", None) or None,
                "drafter_engine_build": (getattr(coordinators["model"].drafter_info, "engine_build", None) or None)
                if need_model else None,
                "draft_dtype": coordinators["model"].drafter_info.dtype if need_model else None,
                # "shared" (the target's token ids) or "translated" (another tokenizer, drafts through text)
                "draft_tokenizer": coordinators["model"].engines.get("draft_tokenizer") if need_model else None,
                "ngram": {"min": args.ngram_min, "max": args.ngram_max} if need_ngram else None,
                # The weights each worker loaded, and on which engine: what running the baselines beside them needs.
                "worker_weights": {role: {"bytes": worker.weights_bytes, "engine": worker.engine}
                                   for role, worker in (("verifier", base.verifier_info),
                                                        ("drafter", coordinators["model"].drafter_info
                                                         if need_model else None)) if worker is not None},
                # The verifier's measured cost curve (Info.verify_costs): v(k drafts) over a 0-draft verify.
                "verify_curve": verify_curve(base.verifier_info),
                # The fastest health check to each worker: the network round trip the rounds pay.
                "rtt_ms": {role: round(1000 * s, 3)
                           for role, s in coordinators["model" if need_model else None].round_trip_s.items()}}

        prompt_ids = {p["id"]: base.encode_prompt(p["prompt"], chat=not args.no_chat) for p in prompts}
        warm = prompt_ids[prompts[0]["id"]]
        for name, c in coordinators.items():  # warm caches, allocators and channels of every worker
            c.generate(list(warm), GenerationOptions(max_new_tokens=8, draft_tokens=0 if name is None else None))

        def run(prompt: dict, mode: Mode) -> dict:
            options = GenerationOptions(max_new_tokens=args.max_new_tokens, draft_tokens=mode.k,
                                        draft_policy=mode.policy, pipeline=mode.pipeline,
                                        stream_flush_s=args.stream_flush_ms / 1000,
                                        stream_guesses=mode.stream_guesses)
            return specmesh_row(coordinators[mode.coordinator].generate(list(prompt_ids[prompt["id"]]), options),
                                prompt, mode)

        yield Runner(info, run, prompt_ids)
        # Memory after every generation: what the workers hold (resident set vs the weights as loaded).
        info["memory"] = {role: worker_memory(c, role) for role, c in (("verifier", base),
                                                                      ("drafter", coordinators.get("model")))
                          if c is not None}


def verify_curve(info) -> dict[str, float] | None:
    costs = sorted((c.drafts, c.seconds) for c in getattr(info, "verify_costs", ()))
    if not costs or costs[0][0] != 0 or costs[0][1] <= 0:
        return None
    return {"one_token_ms": round(1000 * costs[0][1], 2),
            **{f"v({k + 1})": round(seconds / costs[0][1], 3) for k, seconds in costs[1:]}}


def worker_memory(coordinator: Coordinator, role: str) -> dict:
    pool = coordinator.verifiers if role == "verifier" else coordinator.drafters
    reply = pool.endpoints[0].info()
    return {"resident_bytes": reply.resident_bytes, "weights_bytes": reply.weights_bytes}

"""Who uses the cores while specmesh generates: CPU time of every process (coordinator, verifier, drafter) and of their
busiest threads, per generation, beside HF `generate()` in this process on the same model, dtype and threads.

A forward pass on 2 threads keeps 2 cores busy; a worker that shows fewer (1.6 instead of 2) spends the rest waiting,
which is how the libgomp finding (docs/engines.md) showed up (an OpenMP team sleeping between parallel regions). Then
`--omp-team-experiment` repeats that finding in one process: one-token steps of the target on this thread, alone and
while another thread holds an OpenMP team of its own (it ran one parallel torch op).

    python scripts/profile_cores.py --threads 2 --sequence T,A,T --max-new-tokens 32
    python scripts/profile_cores.py --omp-team-experiment
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import psutil

from coordinator import Coordinator, GenerationOptions
from specmesh_bench.prompts import DEFAULT_PROMPTS
from coordinator.fleet.local_workers import LocalWorkerSpec, local_workers
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL


def cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, tuple[float, dict[int, float]]]:
    """Per process: its CPU seconds and those of each of its threads."""
    return {name: (sum(p.cpu_times()[:2]), {t.id: t.user_time + t.system_time for t in p.threads()})
            for name, p in processes.items()}


def cores_busy(before: dict, after: dict, wall_s: float) -> dict[str, str]:
    """Cores each process kept busy over wall_s, and its two busiest threads'."""
    report = {}
    for name, (total, threads) in after.items():
        busiest = sorted((t - before[name][1].get(tid, 0.0) for tid, t in threads.items()), reverse=True)[:2]
        report[name] = (f"{(total - before[name][0]) / wall_s:.2f} cores "
                        f"(threads {', '.join(f'{b / wall_s:.2f}' for b in busiest)})")
    return report


def profile_specmesh(args, prompts: list[str]) -> list[list[int]]:
    """Returns the prompts' token ids (chat-templated where the model has a template) for the HF run."""
    common = dict(device="cpu", dtype=args.dtype, threads=args.threads, engine="transformers")
    specs = [LocalWorkerSpec("verifier", args.target_model, **common)]
    if "A" in args.sequence:
        specs.append(LocalWorkerSpec("drafter", args.draft_model, **common))
    with ExitStack() as stack:
        addresses = dict(stack.enter_context(local_workers(specs, one_at_a_time=True)))
        target_only = stack.enter_context(Coordinator(verifier=addresses["verifier"]))
        speculative = (stack.enter_context(Coordinator(verifier=addresses["verifier"], drafter=addresses["drafter"],
                                                       tokenizer=target_only.tokenizer))
                       if "drafter" in addresses else None)
        me = psutil.Process()
        processes = {"coordinator": me}
        for child in me.children():
            processes["verifier" if "verifier" in " ".join(child.cmdline()) else "drafter"] = child
        encoded = [target_only.encode_prompt(prompt, chat=True) for prompt in prompts]
        for i, ids in enumerate(encoded):
            for step in args.sequence:
                coordinator = target_only if step == "T" else speculative
                before, started = cpu_seconds(processes), time.perf_counter()
                result = coordinator.generate(list(ids), GenerationOptions(
                    max_new_tokens=args.max_new_tokens, draft_tokens=0 if step == "T" else None))
                wall = time.perf_counter() - started
                steady = result.rounds[1:]
                verify_ms = 1000 * statistics.median(r.verify_s for r in steady) if steady else float("nan")
                print(f"prompt {i} {'target-only' if step == 'T' else 'adaptive':11s} "
                      f"{result.stats['tokens_per_s']:5.2f} tok/s, median verify {verify_ms:6.1f} ms | "
                      + "; ".join(f"{k} {v}" for k, v in cores_busy(before, cpu_seconds(processes), wall).items()),
                      flush=True)
    return encoded


def profile_hf(args, encoded: list[list[int]]) -> None:
    import torch
    from transformers import GenerationConfig

    from specmesh.runtime.models import load_model

    target = load_model(args.target_model, device="cpu", dtype=args.dtype, threads=args.threads, progress=False)
    me = {"hf": psutil.Process()}
    for i, ids in enumerate(encoded):
        x = torch.tensor([list(ids)])
        before, started = cpu_seconds(me), time.perf_counter()
        with torch.inference_mode():
            target.model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=GenerationConfig(
                max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False))
        wall = time.perf_counter() - started
        print(f"prompt {i} HF generate {args.max_new_tokens / wall:5.2f} tok/s | "
              f"{cores_busy(before, cpu_seconds(me), wall)['hf']}", flush=True)


def omp_team_experiment(args) -> None:
    import torch

    from specmesh.runtime.kv_cache import CachedSequence
    from specmesh.runtime.models import load_model
    from specmesh.worker.cost_probe import probe_context

    model = load_model(args.target_model, device="cpu", dtype=args.dtype, threads=args.threads, progress=False).model
    me = psutil.Process()

    def steps(label: str) -> None:
        sequence, tokens = CachedSequence(model), probe_context(model.config.vocab_size, 64)
        logits = sequence.logits_for(tokens, 1)
        times, before = [], sum(me.cpu_times()[:2])
        started = time.perf_counter()
        for _ in range(args.steps):
            tokens.append(int(logits[-1].argmax()))
            t = time.perf_counter()
            logits = sequence.logits_for(tokens, 1)
            times.append(time.perf_counter() - t)
        cores = (sum(me.cpu_times()[:2]) - before) / (time.perf_counter() - started)
        print(f"{label:34s} one-token step median {1000 * statistics.median(times):6.1f} ms, {cores:.2f} cores busy, "
              f"{me.num_threads()} threads", flush=True)

    steps("alone")
    release = threading.Event()

    def hold_a_team() -> None:
        torch.randn(1_000_000).argmax()  # one parallel op: this thread now has an OpenMP team of its own
        release.wait()

    holder = threading.Thread(target=hold_a_team)
    holder.start()
    time.sleep(0.5)
    steps("another thread holds an OpenMP team")
    release.set()
    holder.join()
    steps("that thread has ended")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="profile_cores.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-model", default=DEFAULT_TARGET_MODEL)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default: torch's)")
    parser.add_argument("--prompts", type=int, default=2, help="first N code prompts of the committed set")
    parser.add_argument("--sequence", default="T,A,T",
                        help="per prompt, generations in order: T target-only, A adaptive (default: T,A,T)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12, help="one-token steps per phase of the experiment")
    parser.add_argument("--no-hf", action="store_true", help="skip HF generate()")
    parser.add_argument("--omp-team-experiment", action="store_true",
                        help="only the in-process experiment: steps alone vs while another thread holds a team")
    args = parser.parse_args(argv)
    args.sequence = [s.strip().upper() for s in args.sequence.split(",") if s.strip()]
    if not args.sequence or set(args.sequence) - {"T", "A"}:
        parser.error("--sequence takes T and A, comma separated")
    if args.omp_team_experiment:
        omp_team_experiment(args)
        return 0
    prompts = [p["prompt"] for p in json.loads(Path(DEFAULT_PROMPTS).read_text())["prompts"]
               if p["class"] == "code"][:args.prompts]
    encoded = profile_specmesh(args, prompts)
    if not args.no_hf:
        profile_hf(args, encoded)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the workers hold: each one's resident set against its weights, after warm-up and after many generations.

Starts a verifier and a drafter subprocess on the default pair (or the models given), warms them up with one
generation per prompt of the prompt set, reads `Info` (resident bytes, weights' bytes), runs --generations more
speculative generations over the same prompts (cycled), reading `Info` every 10, then reads it once more. Exits 1
when a worker holds more than --max-ratio times its weights or grew by more than --max-growth between the warm-up
reading and the last.

    python scripts/worker_memory.py --engine transformers --dtype float32
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from coordinator import Coordinator, GenerationOptions
from specmesh_bench.prompts import DEFAULT_PROMPTS, load_prompts
from coordinator.fleet.local_workers import LocalWorkerSpec, local_workers
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

GIB = 2**30


def readings(coordinator: Coordinator) -> dict[str, tuple[int, int]]:
    """{role: (resident bytes, weights' bytes)} from each worker's Info."""
    pools = {"verifier": coordinator.verifiers, "drafter": coordinator.drafters}
    return {role: (info.resident_bytes, info.weights_bytes)
            for role, info in ((role, pool.endpoints[0].info()) for role, pool in pools.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-model", default=DEFAULT_TARGET_MODEL)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--engine", default="transformers", choices=["transformers", "llamacpp", "auto"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--generations", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    parser.add_argument("--max-ratio", type=float, default=1.15, help="resident / weights allowed (default 1.15)")
    parser.add_argument("--max-growth", type=float, default=0.02, help="growth allowed after warm-up (default 2%%)")
    args = parser.parse_args(argv)
    if args.generations < 1 or args.max_new_tokens < 1:
        parser.error("--generations and --max-new-tokens must be at least 1")

    prompts = load_prompts(Path(args.prompts), ["code", "prose", "quote"], None, None)
    common = {"device": "cpu", "dtype": args.dtype, "threads": args.threads, "engine": args.engine}
    specs = [LocalWorkerSpec("verifier", args.target_model, **common),
             LocalWorkerSpec("drafter", args.draft_model, **common)]
    with local_workers(specs, one_at_a_time=True) as addresses, \
            Coordinator(addresses["verifier"], addresses["drafter"]) as coordinator:
        encoded = [coordinator.encode_prompt(p["prompt"], chat=True) for p in prompts]
        options = GenerationOptions(max_new_tokens=args.max_new_tokens)
        # Warm-up: every prompt once, so that each prompt's shapes have met the allocators before the first reading.
        for i, prompt in enumerate(encoded):
            coordinator.generate(list(prompt), options)
            print(f"\rwarm-up {i + 1}/{len(encoded)}", end="", file=sys.stderr, flush=True)
        warm = readings(coordinator)
        trail = []  # the readings on the way, every 10 generations: growth that goes on, or a plateau
        for i, prompt in zip(range(args.generations), itertools.cycle(encoded)):
            coordinator.generate(list(prompt), options)
            print(f"\rgeneration {i + 1}/{args.generations}", end="", file=sys.stderr, flush=True)
            if (i + 1) % 10 == 0:
                trail.append(readings(coordinator))
        print(file=sys.stderr)
        after = readings(coordinator)

    print(f"engine {args.engine}, {args.dtype}; warm-up: each of {len(prompts)} prompts once; then {args.generations} "
          f"generations of up to {args.max_new_tokens} tokens over the same prompts")
    print("| worker | weights | after warm-up | after the generations | growth |")
    print("| --- | ---: | ---: | ---: | ---: |")
    failed = []
    for role in ("verifier", "drafter"):
        (warm_rss, weights), (after_rss, _) = warm[role], after[role]
        growth = after_rss / warm_rss - 1
        print(f"| {role} | {weights / GIB:.2f} GiB | {warm_rss / GIB:.2f} GiB ({warm_rss / weights:.2f}x) | "
              f"{after_rss / GIB:.2f} GiB ({after_rss / weights:.2f}x) | {100 * growth:+.1f}% |")
        if max(warm_rss, after_rss) > args.max_ratio * weights:
            failed.append(f"{role} holds more than {args.max_ratio}x its weights")
        if growth > args.max_growth:
            failed.append(f"{role} grew {100 * growth:.1f}% (allowed {100 * args.max_growth:.0f}%)")
    for role in ("verifier", "drafter"):
        print(f"{role}, resident every 10 generations: " + ", ".join(f"{r[role][0] / GIB:.3f}" for r in trail) + " GiB")
    for message in failed:
        print(f"FAILED: {message}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

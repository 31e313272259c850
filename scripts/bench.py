"""Side-by-side benchmark of target-only decoding and speculative decoding over gRPC, in one process run.

Starts one verifier and one drafter (local subprocesses unless addresses are given), then for each prompt runs
target-only decoding (`--draft-tokens 0`, the baseline) and each speculative mode on the SAME workers, and prints
per-mode tokens/s, speedup over target-only (ratio of per-prompt times), acceptance rate, mean accepted length, rounds,
and where (if anywhere) the output first diverges from target-only (expected only in bf16).

    python scripts/bench.py --max-new-tokens 128 --modes 0,adaptive,4 --json bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from coordinator import Coordinator, GenerationOptions  # noqa: E402
from coordinator.workers import LocalWorkerSpec, local_workers  # noqa: E402
from specmesh.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL  # noqa: E402

PROMPTS = {
    "code": [
        "Write a Python function that checks whether a number is prime.",
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a JavaScript function that debounces another function.",
        "Write a SQL query that returns the ten customers with the highest total order value.",
    ],
    "prose": [
        "Explain what a hash map is to a new programmer.",
        "Describe the water cycle in a short paragraph.",
    ],
}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verifier"), parser.add_argument("--drafter")
    parser.add_argument("--target-model", default=DEFAULT_TARGET_MODEL)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--dtype", default="auto"), parser.add_argument("--device", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--modes", default="0,adaptive,4", help="comma list: 0 (target-only), adaptive, or a k")
    parser.add_argument("--classes", default="code,prose")
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON here")
    args = parser.parse_args()

    modes = [m.strip() for m in args.modes.split(",")]
    if "0" not in modes:
        modes.insert(0, "0")
    prompts = [(c, p) for c in args.classes.split(",") for p in PROMPTS[c]]
    specs = []
    if not args.verifier:
        specs.append(LocalWorkerSpec("verifier", args.target_model, args.device, args.dtype))
    if not args.drafter:
        specs.append(LocalWorkerSpec("drafter", args.draft_model, args.device, args.dtype))
    rows = []
    with ExitStack() as stack:
        addresses = stack.enter_context(local_workers(specs)) if specs else {}
        c = stack.enter_context(Coordinator(verifier=args.verifier or addresses["verifier"],
                                            drafter=args.drafter or addresses["drafter"]))
        c.generate(prompts[0][1], GenerationOptions(max_new_tokens=8))  # warm both workers' caches and allocators
        for cls, prompt in prompts:
            baseline = None
            for mode in modes:
                k = None if mode == "adaptive" else int(mode)
                r = c.generate(prompt, GenerationOptions(max_new_tokens=args.max_new_tokens, draft_tokens=k))
                if mode == "0":
                    baseline = r
                rows.append({"class": cls, "prompt": prompt, "mode": mode, **r.stats,
                             "speedup": baseline.stats["elapsed_s"] / r.stats["elapsed_s"],
                             "diverges_at": first_divergence(baseline.token_ids, r.token_ids)})
                print(f"{cls:5s} {mode:>8s} {r.stats['tokens_per_s']:7.2f} tok/s  speedup "
                      f"{rows[-1]['speedup']:.2f}x  accept {r.stats['acceptance_rate']}  "
                      f"diverges_at {rows[-1]['diverges_at']}  | {prompt[:40]}", file=sys.stderr)
        info = {"target": c.verifier_info.model_name, "draft": c.drafter_info.model_name,
                "dtype": c.verifier_info.dtype, "device": c.verifier_info.device}

    print(f"\n{info['draft']} -> {info['target']}, {info['dtype']} on {info['device']}, "
          f"{args.max_new_tokens} new tokens at most\n")
    print("| class | mode | tokens/s | speedup vs target-only | acceptance rate | mean accepted length | rounds |"
          " first divergence |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cls in [*args.classes.split(","), "all"]:
        for mode in modes:
            sel = [r for r in rows if r["mode"] == mode and (cls == "all" or r["class"] == cls)]
            if not sel:
                continue
            tokens = sum(r["new_tokens"] for r in sel)
            seconds = sum(r["elapsed_s"] for r in sel)
            drafted = sum(r["drafted_tokens"] for r in sel)
            accepted = sum(r["accepted_tokens"] for r in sel)
            rounds = sum(r["rounds"] for r in sel)
            div = [r["diverges_at"] for r in sel if r["diverges_at"] is not None]
            print(f"| {cls} | {'target-only' if mode == '0' else 'k=' + mode} | {tokens / seconds:.2f} | "
                  f"{statistics.geometric_mean(r['speedup'] for r in sel):.2f}x | "
                  f"{(accepted / drafted if drafted else float('nan')):.1%} | {tokens / rounds:.2f} | {rounds} | "
                  f"{(f'{len(div)}/{len(sel)} prompts, earliest token {min(div)}' if div else 'none')} |")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

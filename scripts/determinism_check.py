"""Does the same request get the same answer whatever else runs? The check of docs/engines.md#determinism.

Starts two verifiers and a drafter as real worker processes (tiny test models by default, the transformers engine),
sends the same N requests twice through one Coordinator with C concurrent callers (half greedy, half seeded
sampling), optionally SIGKILLs a verifier during the second pass, and reports how many answers of the second pass
repeat the first's, and the tokens/s of each pass:

    python scripts/determinism_check.py --dtype bfloat16 --deterministic --concurrency 8
    python scripts/determinism_check.py --dtype bfloat16 --no-deterministic --kill
    python scripts/determinism_check.py --concurrency 1 --requests 8   # tokens/s of one session at a time

Run it under `flock /tmp/specmesh-heavy.lock` on a shared machine: it uses every core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator import Coordinator, GenerationOptions  # noqa: E402
from coordinator.fleet.local_workers import LocalWorker, LocalWorkerSpec  # noqa: E402
from specmesh.runtime.tokenizer import load_tokenizer  # noqa: E402

TEXTS = ("def fibonacci(n):", "Once upon a time", "SELECT * FROM", "import numpy as np\n", "hello world",
         "The quick brown fox", "class Stack:", "for i in range(10):", "Dear Sir or Madam,", "# TODO: fix",
         "async def main():", "The capital of France", "<html><body>", "fn main() {", "Q: What is 2+2?\nA:",
         "Lorem ipsum dolor", "while True:", "It was a dark and", "#include <stdio.h>", "user@example.com")


def requests(n: int, max_new: int) -> list[tuple[str, GenerationOptions]]:
    """Half greedy, half seeded sampling, over the texts (a text comes back with other options: prefix-cache hits)."""
    out = []
    for i in range(n):
        text = TEXTS[i % len(TEXTS)]
        if i % 2 == 0:
            options = GenerationOptions(max_new_tokens=max_new, chat=False)
        else:
            options = GenerationOptions(max_new_tokens=max_new, chat=False, temperature=0.8, top_p=0.95,
                                        seed=1000 + i)
        out.append((text, options))
    return out


def run_pass(coordinator: Coordinator, work, concurrency: int, on_done=None) -> tuple[list[str | None], float, int]:
    """Every request once with `concurrency` callers: (texts, seconds, new tokens); None where one failed."""
    results: list[str | None] = [None] * len(work)
    tokens = [0]
    lock = threading.Lock()

    def one(index: int) -> None:
        text, options = work[index]
        try:
            result = coordinator.generate(text, options)
        except Exception as e:  # noqa: BLE001 - counted as failed, reported
            print(f"request {index} failed: {e}", file=sys.stderr)
            return
        results[index] = result.text
        with lock:
            tokens[0] += len(result.token_ids)
        if on_done is not None:
            on_done()

    order = list(range(len(work)))
    random.Random(len(work)).shuffle(order)  # another order than the requests' own: other neighbours in a pass
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, order))
    return results, time.perf_counter() - started, tokens[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="tiny-random-qwen2")
    parser.add_argument("--draft", default="tiny-random-qwen2-b")
    parser.add_argument("--engine", default="transformers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                        help="passed to the workers (default: the workers' default)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--draft-tokens", type=int, default=None, help="fixed k (default: the adaptive policy)")
    parser.add_argument("--kill", action="store_true", help="SIGKILL a verifier during the second pass")
    parser.add_argument("--verifiers", type=int, default=2, help="verifier processes (--kill needs 2)")
    parser.add_argument("--threads", type=int, default=1, help="threads of each worker")
    parser.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    args = parser.parse_args(argv)

    # The workers measure their costs at once, without waiting for a quiet machine (a shared one may never be).
    os.environ.setdefault("SPECMESH_PROBE_QUIET_SAMPLE_S", "0")
    flags = {None: (), True: ("--deterministic",), False: ("--no-deterministic",)}[args.deterministic]
    work = requests(args.requests, args.max_new_tokens)
    if args.draft_tokens is not None:
        work = [(text, GenerationOptions(**{**options.__dict__, "draft_tokens": args.draft_tokens}))
                for text, options in work]
    with tempfile.TemporaryDirectory(prefix="determinism-") as logs, ExitStack() as stack:
        def start(role: str, model: str) -> LocalWorker:
            worker = LocalWorker(LocalWorkerSpec(role, model, "cpu", args.dtype, threads=args.threads,
                                                 engine=args.engine, extra_args=flags), logs)
            stack.callback(worker.stop)
            return worker
        verifiers = [start("verifier", args.target) for _ in range(args.verifiers)]
        drafter = start("drafter", args.draft) if args.draft_tokens != 0 else None  # target-only: no drafter
        for worker in [*verifiers, *([drafter] if drafter else [])]:
            worker.wait_serving(300)
            worker.wait_costs(300)  # the cost policy starts from them: the same prior in both passes
        coordinator = stack.enter_context(Coordinator(verifier=[v.address for v in verifiers],
                                                      drafter=drafter.address if drafter else None,
                                                      tokenizer=load_tokenizer(args.target)))
        first, first_s, first_tokens = run_pass(coordinator, work, args.concurrency)
        done = [0]

        def maybe_kill() -> None:
            done[0] += 1
            if args.kill and done[0] == len(work) // 4:
                verifiers[0].kill()
        second, second_s, second_tokens = run_pass(coordinator, work, args.concurrency, maybe_kill)

    greedy = [i for i, (_, o) in enumerate(work) if o.temperature == 0]
    seeded = [i for i in range(len(work)) if i not in greedy]
    same = {name: sum(1 for i in idx if first[i] is not None and first[i] == second[i])
            for name, idx in (("greedy", greedy), ("seeded", seeded))}
    report = {"engine": args.engine, "dtype": args.dtype, "deterministic": args.deterministic,
              "concurrency": args.concurrency, "requests": len(work), "kill": args.kill,
              "identical": same["greedy"] + same["seeded"], "identical_greedy": same["greedy"],
              "identical_seeded": same["seeded"], "greedy": len(greedy), "seeded": len(seeded),
              "succeeded": sum(t is not None for t in second),
              "tokens_per_s_first": round(first_tokens / first_s, 1),
              "tokens_per_s_second": round(second_tokens / second_s, 1)}
    print(json.dumps(report))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Aggregate throughput of several concurrent generations through ONE verifier and ONE drafter, with and without
cross-session batching on both (`verifier serve` / `drafter serve --max-batch-size 1` vs N), in one run on the same
models and prompts.

For each batching setting a verifier (and a model drafter) start as local subprocesses; then, per decoding mode
(target-only, adaptive, or a fixed draft length k) and per concurrency level, that many generations run at once from
threads of one coordinator. Reported: aggregate tokens/s (all tokens / wall time), the ratio batched / unbatched,
scaling over one generation, and the mean number of sessions per verifier forward pass and per draft step (from the
workers' Prometheus histograms).

    coordinator bench-concurrency --concurrency 1,2,4,8 --max-new-tokens 32 --out-dir bench-out
    coordinator bench-concurrency --modes 4 --draft-max-batch-size 1   # batch the verifier only
    python scripts/bench_concurrency.py --modes target-only --concurrency 1,4 --target-model tiny-random-qwen2 \
        --draft-model tiny-random-qwen2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coordinator import Coordinator, GenerationOptions
from specmesh_bench.prompts import DEFAULT_PROMPTS
from coordinator.fleet.resilience import ResilienceConfig
from coordinator.fleet.local_workers import LocalWorkerSpec, free_port, local_workers
from specmesh.ops.flags import DefaultsHelpFormatter
from specmesh.ops.metrics import read_histogram
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
from specmesh.runtime.engine import ENGINES

MODES = {"target-only": 0, "adaptive": None}  # and any k >= 1 written as a number: a fixed draft length
# Calls queue behind each other's prompts (prefill) on an overloaded verifier: measure throughput, not deadlines.
PATIENT = ResilienceConfig(verify_timeout_s=900, propose_timeout_s=900, retry_budget_s=900)


def draft_tokens(mode: str) -> int | None:
    """The generation's --draft-tokens for a mode name: 0, None (adaptive) or the fixed k."""
    return MODES[mode] if mode in MODES else int(mode)


def valid_mode(mode: str) -> bool:
    return mode in MODES or (mode.isdigit() and int(mode) >= 1)


# Row key -> the worker histogram it is the mean of: sessions per verifier forward pass, per draft step.
MEAN_BATCHES = {"mean_batch": "specmesh_verify_batch_size", "mean_draft_batch": "specmesh_draft_batch_size"}


def batch_histograms(metrics_ports: dict[str, int | None]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each worker's batch size histogram, by MEAN_BATCHES key; workers without a port are left out."""
    return {key: read_histogram(f"http://127.0.0.1:{port}/metrics", MEAN_BATCHES[key])
            for key, port in metrics_ports.items() if port is not None}


def mean_batches(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """Mean batch size of the passes between two readings, by MEAN_BATCHES key (None: no pass)."""
    means: dict[str, float | None] = dict.fromkeys(MEAN_BATCHES)
    for key in after:
        passes = after[key][1] - before[key][1]
        means[key] = (after[key][0] - before[key][0]) / passes if passes else None
    return means


def run_concurrent(coordinator: Coordinator, prompts: list[str], n: int, options: GenerationOptions) -> dict:
    chosen = [prompts[i % len(prompts)] for i in range(n)]
    started = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda p: coordinator.generate(p, options), chosen))
    wall = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    drafted = sum(r.stats.get("drafted_tokens", 0) for r in results)
    accepted = sum(r.stats.get("accepted_tokens", 0) for r in results)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": tokens / wall,
            "acceptance_rate": accepted / drafted if drafted else None,
            "token_ids": [r.token_ids for r in results]}


def run(args: argparse.Namespace) -> dict:
    prompts_by_class = json.loads(args.prompts.read_text())
    prompts = [p["prompt"] for p in prompts_by_class["prompts"] if p["class"] in args.classes.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    speculative = any(draft_tokens(m) != 0 for m in modes)
    draft_batched = args.max_batch_size if args.draft_max_batch_size is None else args.draft_max_batch_size
    rows = []
    # Off: both workers one session per pass. On: the verifier batches, and the drafter unless told otherwise.
    for batch_size, draft_batch_size in ((1, 1), (args.max_batch_size, draft_batched)):
        verifier_metrics, drafter_metrics = free_port(), free_port()
        specs = [LocalWorkerSpec("verifier", args.target_model, args.device, args.dtype, args.threads,
                                 engine=args.engine, extra_args=("--max-batch-size", str(batch_size),
                                                                 "--metrics-port", str(verifier_metrics)))]
        if speculative:
            specs.append(LocalWorkerSpec("drafter", args.draft_model, args.device, args.dtype, args.threads,
                                         engine=args.engine, extra_args=("--max-batch-size", str(draft_batch_size),
                                                                         "--metrics-port", str(drafter_metrics))))
        metrics_ports = {"mean_batch": verifier_metrics, "mean_draft_batch": drafter_metrics if speculative else None}
        with local_workers(specs) as addresses, \
                Coordinator(verifier=addresses["verifier"], drafter=addresses.get("drafter"),
                            resilience=PATIENT) as coordinator:
            for mode in modes:
                options = GenerationOptions(max_new_tokens=args.max_new_tokens, draft_tokens=draft_tokens(mode))
                coordinator.generate(prompts[0], GenerationOptions(max_new_tokens=2, draft_tokens=draft_tokens(mode)))
                for n in levels:
                    before = batch_histograms(metrics_ports)
                    row = run_concurrent(coordinator, prompts, n, options)
                    row.update(mean_batches(before, batch_histograms(metrics_ports)), mode=mode, concurrency=n,
                               max_batch_size=batch_size,
                               draft_max_batch_size=draft_batch_size if speculative else None)
                    rows.append(row)
                    print(f"{mode:>11s} n={n} max_batch={batch_size} draft_max_batch={draft_batch_size}: "
                          f"{row['tokens_per_s']:.2f} tok/s ({row['tokens']} tokens in {row['wall_s']:.1f}s), "
                          f"mean batch {row['mean_batch'] or 0:.2f} verify, {row['mean_draft_batch'] or 0:.2f} draft",
                          file=sys.stderr, flush=True)
    return {"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows}


def markdown(report: dict) -> str:
    rows = report["rows"]
    batched = max(int(r["max_batch_size"]) for r in rows)
    lines = ["| mode | concurrent | tok/s unbatched | tok/s batched | batched / unbatched | sessions per verify pass "
             "| sessions per draft step | scaling (batched, vs 1) | same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        one = next((r for r in rows if r["mode"] == mode and r["max_batch_size"] == batched
                    and r["concurrency"] == 1), None)
        for n in dict.fromkeys(r["concurrency"] for r in rows if r["mode"] == mode):
            off = next(r for r in rows if r["mode"] == mode and r["concurrency"] == n and r["max_batch_size"] == 1)
            on = next(r for r in rows if r["mode"] == mode and r["concurrency"] == n
                      and r["max_batch_size"] == batched)
            scaling = on["tokens_per_s"] / one["tokens_per_s"] if one else None
            lines.append(f"| {mode} | {n} | {off['tokens_per_s']:.2f} | {on['tokens_per_s']:.2f} | "
                         f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x | {on['mean_batch'] or 0:.2f} | "
                         f"{'–' if on.get('mean_draft_batch') is None else format(on['mean_draft_batch'], '.2f')} | "
                         f"{'–' if scaling is None else f'{scaling:.2f}x'} | "
                         f"{'yes' if on['token_ids'] == off['token_ids'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--target-model", default=DEFAULT_TARGET_MODEL, help="the verifier's model")
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL, help="the drafter's model")
    parser.add_argument("--dtype", default="auto", help="dtype of the workers")
    parser.add_argument("--device", default="auto", help="device of the workers")
    parser.add_argument("--engine", default="auto", choices=ENGINES, help="engine of both workers")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of each worker (default: the worker's choice)")
    parser.add_argument("--modes", default="target-only,adaptive",
                        help="comma list of: target-only, adaptive, or a number k (a fixed draft length)")
    parser.add_argument("--concurrency", default="1,2,4,8", help="concurrent generations to measure")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="the batched run's verifier --max-batch-size (the other run: 1 on both workers)")
    parser.add_argument("--draft-max-batch-size", type=int, default=None,
                        help="the batched run's drafter --max-batch-size; 1 batches the verifier only "
                        "(default: --max-batch-size)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per generation at most")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="prompt set (JSON)")
    parser.add_argument("--classes", default="code,prose,quote", help="prompt classes to draw prompts from")
    parser.add_argument("--out-dir", type=Path, default=None, help="write concurrency.json and concurrency.md here")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if not valid_mode(m.strip())]
    if unknown:
        print(f"{parser.prog}: error: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)} or a "
              "draft length k >= 1", file=sys.stderr)
        return 2
    report = run(args)
    table = markdown(report)
    print(table)
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "concurrency.json").write_text(json.dumps(report, indent=1))
        (args.out_dir / "concurrency.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

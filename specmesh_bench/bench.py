"""Side-by-side benchmark: specmesh target-only, speculative (draft model, adaptive or fixed k), n-gram drafting, and
in-process Hugging Face transformers and llama.cpp baselines, on the same prompts, models and dtype, in one run.

The specmesh side starts a verifier, a model drafter and an n-gram drafter (`drafter serve --method ngram`) as local
subprocesses (or uses the given addresses) and runs target-only decoding (k = 0, the baseline) and every specmesh mode
on the SAME workers. The HF side loads the models in-process with specmesh.runtime.models.load_model and runs
`model.generate()` (target-only) and `model.generate(assistant_model=draft)` (HF assisted generation, HF's defaults)
greedily on the same chat-templated prompt ids with the same max_new_tokens (`hf-ngram`: `prompt_lookup_num_tokens`).
The llama.cpp side (GGUF targets only: catalog names and .gguf paths) loads the target's GGUF with llama-cpp-python's
high-level `Llama` and runs its own greedy loop (`llama-target`) and its prompt-lookup decoding (`llama-lookup`:
LlamaPromptLookupDecoding, --hf-prompt-lookup-tokens and --ngram-max) on the same prompt ids; with a non-GGUF target
(or without llama-cpp-python) these modes are skipped with a note. All decoding is greedy.

`--order interleaved` (the default) loads every side at once and runs each prompt through every mode back to back,
each prompt starting one mode later than the one before: a machine whose speed drifts over minutes (shared hosts)
then slows every side alike, where a phased run once put a 10% drift between specmesh and HF. It needs memory for the
baselines' models beside the workers' and falls back to `--order phased` (all specmesh modes, then the workers stop
and each baseline side runs in turn) with a note when there is not enough.

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

    coordinator bench --classes code,quote --limit-prompts 2 --max-new-tokens 64 --out-dir bench-out
    coordinator bench --topology split --delays-ms 0,1,5,20 --classes code --limit-prompts 2 --out-dir split-out
    python scripts/bench.py --modes target-only,adaptive,4,ngram --limit-prompts code=2,prose=1,quote=1

`--topology split` runs drafter, verifier and coordinator on three "hosts" (network namespaces, each worker pinned to
a core of its own, one-way link delays swept over --delays-ms; specmesh_bench/split.py) and reports tokens/s,
speedups, acceptance and round time against the round trip; it needs root and iproute2 (exit status 3 otherwise).

Writes JSON, a markdown report and a PNG plot of the speedup per prompt (needs matplotlib) when asked. The JSON
records where it came from ("run": the command line, the date, the specmesh revision and the machine: CPU model,
flags, cores, memory) beside the engines ("config", "info").

Results pages are generated from saved reports, never edited by hand: `--from-json` takes several reports, and a
`--markdown` file holding the line `<!-- generated results below: do not edit by hand -->` keeps everything up to
that line and gets the rest rewritten with a section per report (sorted by file name; a heading with its name,
machine and date, the command, then the tables the bench prints):

    coordinator bench --modes target-only,adaptive-cost --limit-prompts 1 --json docs/results/smoke.json
    coordinator bench --from-json docs/results/*.json --markdown docs/benchmarks.md     # make docs-results
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from specmesh_bench.analysis import add_relative, summarize
from specmesh_bench.engines import requested_engines, resolved_engines
from specmesh_bench.hf_baseline import hf_runner
from specmesh_bench.interleave import cannot_interleave
from specmesh_bench.ik_baseline import ik_runner
from specmesh_bench.llamacpp_baseline import llamacpp_runner
from specmesh_bench.machine import cpu_features, llamacpp_system_info, load_average, run_record
from specmesh_bench.modes import DEFAULT_MODES, drop_unrunnable, parse_modes
from specmesh_bench.prompts import DEFAULT_PROMPTS, load_prompts
from specmesh_bench.netns import MeshUnavailable
from specmesh_bench.reports import MARKER, plot, report_markdown, results_markdown, splice, split_plot
from specmesh_bench.measure import take_turns
from specmesh_bench.specmesh_runs import specmesh_runner
from specmesh_bench.split import DEFAULT_SPLIT_MODES, UNAVAILABLE, SplitUnavailable, run_split
from specmesh_bench import split
from coordinator.stream_flush import DEFAULT_STREAM_FLUSH_S, check_stream_flush_s
from specmesh.ops.flags import DefaultsRawDescriptionHelpFormatter
from specmesh.runtime import onednn
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
from specmesh.runtime.engine import ENGINES
from specmesh.runtime.huge_pages import (on_huge_pages, reexec_on_huge_pages_if_possible, started_with_huge_pages,
                                        thp_mode, workers_on_huge_pages)


def thread_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"expected positive thread counts like 2 or 1,2, got {text!r}")
    return counts


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, allow_abbrev=False,
                                     formatter_class=DefaultsRawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", help="use this running verifier (default: start one)")
    parser.add_argument("--drafter", help="use this running model drafter (default: start one)")
    parser.add_argument("--ngram-drafter", help="use this running `drafter serve --method ngram` (default: start one)")
    parser.add_argument("--target-model", default=DEFAULT_TARGET_MODEL, help="target model, any model spec")
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL, help="draft model, any model spec")
    parser.add_argument("--dtype", default="auto", help="dtype of the workers and the HF baselines")
    parser.add_argument("--device", default="auto", help="device of the workers and the HF baselines")
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="worker engine, both sides (auto: llama.cpp for GGUF/catalog models on CPU with --dtype "
                        "auto, else transformers)")
    parser.add_argument("--target-engine", choices=ENGINES, default=None, help="verifier engine (default: --engine)")
    parser.add_argument("--draft-engine", choices=ENGINES, default=None,
                        help="model drafter engine (default: --engine)")
    parser.add_argument("--draft-requantize", default="auto", metavar="TYPE|auto|none",
                        help="a locally started model drafter runs its GGUF requantized to this type (drafter serve --requantize: auto = q4_0 on the ik engine where the file's weights are wider; none = the file as it is; docs/engines.md#a-cheaper-drafter)")
    parser.add_argument("--threads", type=thread_counts, default=None,
                        help="CPU threads: workers, HF and llama.cpp baselines alike (default: all cores); a comma "
                        "list (e.g. 1,2) sweeps: the whole benchmark runs once per count, baselines included, and "
                        "the report has a section per count plus a tokens/s table across them")
    parser.add_argument("--linear-backend", choices=onednn.BACKENDS, default="auto",
                        help="CPU linear kernels, workers and HF alike (specmesh/runtime/onednn.py; default: auto)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt at most")
    parser.add_argument("--topology", choices=("local", "split"), default="local",
                        help="local: every worker a subprocess on this host's loopback; split: drafter, verifier and "
                        "coordinator in network namespaces, each worker on a core of its own, links delayed "
                        "(see the split topology flags)")
    parser.add_argument("--modes", default=None,
                        help="comma list of target-only (or 0), adaptive, adaptive-cost, pipelined, pipelined-cost, K "
                        "(fixed draft length), ngram, ngram-cost, ngram:K, hf-target, hf-assisted, hf-ngram, "
                        "llama-target, llama-lookup (these two: GGUF targets only, skipped otherwise); target-only is "
                        f"always run (default: {DEFAULT_MODES}; with --topology split: {DEFAULT_SPLIT_MODES})")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="prompt set (JSON)")
    parser.add_argument("--classes", default="code,prose,quote", help="prompt classes to run")
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
    parser.add_argument("--stream-flush-ms", type=float, default=DEFAULT_STREAM_FLUSH_S * 1000,
                        help="specmesh modes: how long the verifier may hold the tokens of a target-only stretch "
                        "before sending them together (as coordinator generate; 0: every token at once)")
    parser.add_argument("--order", choices=("interleaved", "phased"), default="interleaved",
                        help="interleaved: every prompt runs every mode back to back, specmesh and baselines taking "
                        "turns (the baselines' models are loaded beside the workers; falls back to phased when memory "
                        "is short); phased: all specmesh modes, then the workers stop and each baseline runs in turn")
    parser.add_argument("--baseline-huge-pages", action="store_true",
                        help="run this process on transparent huge pages too (it restarts itself with "
                        "glibc.malloc.hugetlb=1, as the workers do by default), so that the in-process baselines "
                        "(ik-target, llama-target, hf-*) hold their weights on the same pages as the workers")
    parser.add_argument("--baseline-cpus", default=None,
                        help="pin the in-process HF and llama.cpp baselines to these CPUs, e.g. 1 or 0,1 (default: "
                        "no pinning; the split topology pins them to the verifier's core)")
    parser.add_argument("--from-json", type=Path, nargs="+", default=None, metavar="JSON",
                        help="run nothing: re-render the reports (markdown, plot) of an earlier run's JSON; several "
                        "(e.g. docs/results/*.json): a markdown section each, into --markdown")
    parser.add_argument("--out-dir", type=Path, default=None, help="write bench.json, bench.md and bench.png here")
    parser.add_argument("--json", dest="json_path", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--markdown", type=Path, default=None,
                        help=f"write the markdown report here; a file holding the line {MARKER} (a results page, "
                        "e.g. docs/benchmarks.md) keeps all up to that line and gets the rest rewritten: a section "
                        "per --from-json report (heading: name, machine, date; the command; the tables)")
    parser.add_argument("--plot", type=Path, default=None, help="write the PNG plot here")
    split.add_arguments(parser)


def load_report(path: Path) -> dict:
    """A saved report with its summaries recomputed from its rows (as the bench computes them today)."""
    report = json.loads(path.read_text())
    if report.get("topology") == "split":
        return report
    for run_report in report.get("sweep", [report]):
        modes = parse_modes(",".join(run_report["config"]["modes"]))
        add_relative(run_report["rows"])
        run_report["summary"] = summarize(run_report["rows"], modes, run_report["config"]["classes"])
    return report


def is_results_page(path: Path | None) -> bool:
    """Whether path is a results page: an existing file holding the MARKER line."""
    try:
        return path is not None and any(line.strip() == MARKER for line in path.read_text().splitlines())
    except (OSError, UnicodeDecodeError):
        return False


def render_results(paths: list[Path]) -> str:
    """The generated part of a results page: a section per saved report, sorted by file name, each named by its file
    name without .json."""
    paths = sorted(paths, key=lambda p: (p.name, str(p)))
    return results_markdown([(path.stem, load_report(path)) for path in paths])


def rerender(args: argparse.Namespace) -> int:
    paths = args.from_json
    try:
        if len(paths) == 1 and not is_results_page(args.markdown):
            write_reports(args, load_report(paths[0]))
            return 0
        if len(paths) > 1 and (args.json_path or args.plot):
            raise ValueError("several --from-json reports render markdown only: drop --json/--plot/--out-dir")
        if not args.markdown:
            raise ValueError("several --from-json reports need --markdown PATH (a results page or a new file)")
        generated = render_results(paths)
        if is_results_page(args.markdown):
            args.markdown.write_text(splice(args.markdown.read_text(), generated))
            print(f"bench: {args.markdown}: {len(paths)} result(s) rewritten after the marker line", file=sys.stderr)
        else:
            args.markdown.write_text(generated)
            print(f"bench: {args.markdown}: {len(paths)} result(s)", file=sys.stderr)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    return 0


def write_json(args: argparse.Namespace, report: dict) -> None:
    if args.json_path:
        args.json_path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")


def write_reports(args: argparse.Namespace, report: dict) -> None:
    if report.get("topology") == "split":
        text = report_markdown(report)
        print("\n" + text)
        write_json(args, report)
        if args.markdown:
            args.markdown.write_text(text)
        if args.plot and split_plot(report, args.plot):
            print(f"plot: {args.plot}", file=sys.stderr)
        return
    text = report_markdown(report)
    print("\n" + text)
    if args.json_path:
        args.json_path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    for run_report in report.get("sweep", [report]):
        path = args.plot
        if path and "sweep" in report:  # one plot per thread count: bench-t1.png, bench-t2.png, ...
            path = path.with_name(f"{path.stem}-t{run_report['config']['threads']}{path.suffix}")
        if path and plot(run_report, path):
            print(f"plot: {path}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        args.json_path = args.json_path or args.out_dir / "bench.json"
        args.markdown = args.markdown or args.out_dir / "bench.md"
        args.plot = args.plot or args.out_dir / "bench.png"
    if args.from_json:
        return rerender(args)
    try:
        if is_results_page(args.markdown):
            raise ValueError(f"{args.markdown} is a results page (it has the line {MARKER}): save this run with --json "
                             "beside the others and re-render them all with --from-json ... --markdown")
        modes = parse_modes(args.modes or (DEFAULT_SPLIT_MODES if args.topology == "split" else DEFAULT_MODES))
        classes = [c.strip() for c in args.classes.split(",") if c.strip()]
        prompts = load_prompts(args.prompts, classes, args.limit_prompts,
                               [i.strip() for i in args.prompt_ids.split(",")] if args.prompt_ids else None)
        if args.max_new_tokens < 1 or args.repeats < 1:
            raise ValueError("--max-new-tokens and --repeats must be >= 1")
        check_stream_flush_s(args.stream_flush_ms / 1000, "--stream-flush-ms")
        engines, resolved = requested_engines(args), resolved_engines(args)
        if args.threads and len(args.threads) > 1 and (args.verifier or args.drafter or args.ngram_drafter):
            raise ValueError("a --threads sweep starts its own workers at each count: drop --verifier/--drafter/"
                             "--ngram-drafter")
        baseline_cpus(args)
        if args.topology == "split":
            if args.verifier or args.drafter or args.ngram_drafter:
                raise ValueError("--topology split starts its own workers: drop --verifier/--drafter/--ngram-drafter")
            if args.threads and len(args.threads) > 1:
                raise ValueError("--topology split takes one --threads count (default 1)")
            split.check_cpus(args)
    except (ValueError, OSError) as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    modes, skipped = drop_unrunnable(modes, args.target_model)
    if args.topology == "split":
        no_host = {m.name: "the split topology has no model-free drafter host" for m in modes
                   if m.drafter in ("ngram", "suffix", "hybrid")
                   and m.kind == "specmesh"}
        no_host.update({m.name: "the split topology runs only target-only baselines" for m in modes
                        if m.kind != "specmesh" and m.drafter is not None})
        modes, skipped = [m for m in modes if m.name not in no_host], {**skipped, **no_host}
    if skipped:
        print(f"bench: note: skipping {', '.join(skipped)}: {next(iter(skipped.values()))}", file=sys.stderr)
    record = run_record(getattr(args, "prog", None) or "coordinator bench", getattr(args, "argv", None) or [])
    if args.topology == "split":
        try:
            report = run_split(args, modes, classes, skipped,
                               on_progress=lambda so_far: write_json(args, {"run": record, **so_far}))
        except (SplitUnavailable, MeshUnavailable) as e:
            print(f"bench: error: the split topology cannot run here: {e}", file=sys.stderr)
            return UNAVAILABLE
        record["load_average_end"] = load_average()
        write_reports(args, {"run": record, **report})
        return 0

    counts = args.threads or [None]
    runs = [measure(argparse.Namespace(**{**vars(args), "threads": n}), modes, prompts, classes, skipped,
                    engines, resolved) for n in counts]
    report = runs[0] if len(runs) == 1 else {"sweep": runs, "config": {"threads": counts}}
    record["load_average_end"] = load_average()
    write_reports(args, {"run": record, **report})
    return 0


def measure(args: argparse.Namespace, modes, prompts: list[dict], classes: list[str], skipped: dict,
            engines: dict, resolved: dict) -> dict:
    """One full benchmark run (every side, baselines included) at args.threads; returns its report."""
    def log(row: dict) -> None:
        acc = row.get("acceptance_rate")
        print(f"{row['class']:5s} {row['mode']:>12s} {row['tokens_per_s']:7.2f} tok/s {row['new_tokens']:4d} tok "
              f"{row['rounds']:4d} rounds  accept {'–' if acc is None else f'{acc:.0%}':>4s}  | {row['prompt_id']}",
              file=sys.stderr, flush=True)

    started = time.time()
    order = args.order
    side_infos: list[dict] = []
    with ExitStack() as stack:
        ours = stack.enter_context(specmesh_runner(args, modes, prompts))
        info, prompt_ids = ours.info, ours.prompt_ids
        baselines = {"hf": lambda: hf_runner(args, modes, prompts, prompt_ids, info["eos_token_ids"]),
                     "llamacpp": lambda: llamacpp_runner(args, modes, prompts, prompt_ids, info["eos_token_ids"]),
                     "ik": lambda: ik_runner(args, modes, prompts, prompt_ids, info["eos_token_ids"])}
        if order == "interleaved" and (why := cannot_interleave(args, modes, info)):
            print(f"bench: note: the sides run one after the other (--order phased): {why}", file=sys.stderr)
            order = "phased"
        if order == "interleaved":
            runners = {"specmesh": ours}
            for kind, open_side in baselines.items():
                if (runner := stack.enter_context(open_side())) is not None:
                    runners[kind] = runner
                    side_infos.append(runner.info)
            rows = take_turns(runners, modes, prompts, args.repeats, log)
        else:
            rows = take_turns({"specmesh": ours}, modes, prompts, args.repeats, log, rotate=False)
    if order == "phased":
        if args.baseline_cpus:  # the specmesh side is over: from here on this process runs the baselines only
            os.sched_setaffinity(0, baseline_cpus(args))
        for kind, open_side in baselines.items():  # one at a time: a side's models are freed before the next loads
            with open_side() as runner:
                if runner is not None:
                    rows += take_turns({kind: runner}, modes, prompts, args.repeats, log, rotate=False)
                    side_infos.append(runner.info)
            runner = None  # its closures hold the models
            gc.collect()
    for side_info in side_infos:
        info.update(side_info)
    add_relative(rows)
    summary = summarize(rows, modes, classes)
    uses_llamacpp = any(r["kind"] == "llamacpp" for r in rows) or "llamacpp" in (info.get("verifier_engine"),
                                                                                 info.get("drafter_engine"))
    system_info = ((info.get("llamacpp") or {}).get("system_info") or llamacpp_system_info()
                   if uses_llamacpp else None)
    report = {
        "info": {**info, "cpu": cpu_features(system_info),
                 "huge_pages": {"thp_mode": thp_mode(), "workers": workers_on_huge_pages(),
                                "baselines": on_huge_pages(started_with_huge_pages())}},
        "config": {"max_new_tokens": args.max_new_tokens, "modes": [m.name for m in modes], "classes": classes,
                   "repeats": args.repeats, "ngram_min": args.ngram_min, "ngram_max": args.ngram_max,
                   "threads": args.threads, "linear_backend": args.linear_backend, "order": order,
                   "engines": engines, "resolved_engines": resolved,
                   "hf_prompt_lookup_tokens": args.hf_prompt_lookup_tokens, "stream_flush_ms": args.stream_flush_ms,
                   "chat": not args.no_chat, "wall_s": round(time.time() - started, 1)},
        "skipped_modes": skipped,
        "prompts": [{**p, "prompt_tokens": len(prompt_ids[p["id"]])} for p in prompts],
        "prompt_counts": {c: sum(p["class"] == c for p in prompts) for c in classes},
        "summary": summary,
        "rows": rows,
    }
    return report


def baseline_cpus(args: argparse.Namespace) -> set[int] | None:
    """--baseline-cpus as a CPU set (None: not given); ValueError when malformed or not usable here."""
    if not args.baseline_cpus:
        return None
    try:
        cpus = {int(part) for part in args.baseline_cpus.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"--baseline-cpus expects CPU numbers like 1 or 0,1, got {args.baseline_cpus!r}") from None
    if not cpus or not cpus <= os.sched_getaffinity(0):
        raise ValueError(f"--baseline-cpus {args.baseline_cpus} is not a set of CPUs this process may use "
                         f"({sorted(os.sched_getaffinity(0))})")
    return cpus


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(prog).parse_args(argv)
    args.argv, args.prog = argv, prog or "coordinator bench"  # recorded in the JSON report ("run")
    if args.baseline_huge_pages and not reexec_on_huge_pages_if_possible():
        print("bench: note: --baseline-huge-pages: the baselines stay on 4 KiB pages (the kernel's THP mode is "
              f"{thp_mode() or 'absent'}, or there is no glibc with glibc.malloc.hugetlb, or GLIBC_TUNABLES sets it "
              "to 0)", file=sys.stderr)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

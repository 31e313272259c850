"""Two versions of the hybrid drafter side by side, on the same workers, in one process run: this checkout's
coordinator/drafting/hybrid.py against the one at a git revision (--old), prompt by prompt, with target-only decoding
(and, with --fixed-k, model drafting at a fixed k) beside them. `coordinator bench` runs one version of the code; a
policy change measured in two bench runs is measured on two states of a shared machine, whose speed moves by a tenth
from minute to minute. Here the versions alternate (each prompt starts one mode later) and every ratio is taken
against target-only generations of the same run.

    python scripts/ab_hybrid.py --old HEAD --prompts docs/check-prompts-2026-12-07c.json

The workers are started as `coordinator bench` starts them (one at a time, each measuring its costs before the next
loads, no prefix cache); each version has a suffix drafter of its own (a shared one would hand the second version
the first one's answer) and learns on its own (coordinator/drafting/learned.py): from nothing, or each from a copy of
the same stored learning (--learned, a file of ~/.cache/specmesh/learned/: what a user's next process starts from).
Prints a table of tokens/s over target-only's per class and whether any output differed from target-only's; --json
writes every generation with its rounds (source, drafted, accepted, draft and verify ms).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import coordinator.api
from coordinator import Coordinator, GenerationOptions
from coordinator.drafting.hybrid import HybridDraftSource
from coordinator.drafting.learned import SourceLearning
from coordinator.fleet.local_workers import LocalWorkerSpec, local_workers
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
from specmesh_bench.machine import cpu_features

REPO = Path(__file__).resolve().parents[1]


def hybrid_at(revision: str, scratch: Path, old_file: str | None = None) -> type:
    """HybridDraftSource as coordinator/drafting/hybrid.py defines it at `revision`, or as `old_file` does (its
    imports: this checkout's)."""
    path = scratch / "hybrid_old.py"
    if old_file:
        path.write_text(Path(old_file).read_text())
    else:
        path.write_text(subprocess.run(["git", "show", f"{revision}:coordinator/drafting/hybrid.py"], cwd=REPO,
                                       check=True, capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location("hybrid_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HybridDraftSource


def rounds_of(result) -> list[tuple]:
    return [(r.source, r.drafted, r.accepted, round(r.draft_s * 1000), round(r.verify_s * 1000)) for r in result.rounds]


def summary(rows: list[dict], modes: list[str]) -> str:
    """Tokens/s over target-only's per class (all of a class's tokens over all of its seconds)."""
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for row in rows:
        for group in (row["class"], "all"):
            total = totals[group][row["mode"]]
            total[0] += row["elapsed_s"]
            total[1] += row["new_tokens"]
    lines = ["| class | " + " | ".join(modes) + " |", "| --- |" + " ---: |" * len(modes)]
    for group, by_mode in totals.items():
        base = by_mode["target-only"][1] / by_mode["target-only"][0]
        lines.append(f"| {group} | " + " | ".join(f"{by_mode[m][1] / by_mode[m][0] / base:.2f}x" for m in modes) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ab_hybrid.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default="HEAD", help="the git revision whose hybrid.py runs as hybrid-old (default HEAD)")
    p.add_argument("--old-file", help="run this file as hybrid-old instead (a hybrid.py being tried out)")
    p.add_argument("--prompts", required=True, help="a prompt set (JSON, as coordinator bench --prompts takes)")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--fixed-k", type=int, default=0, help="also run the draft model alone at this fixed k (0: not)")
    p.add_argument("--target-model", default=DEFAULT_TARGET_MODEL)
    p.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    p.add_argument("--json", help="write every generation, with its rounds, here")
    p.add_argument("--learned", help="each version starts from a copy of this stored learning (default: nothing)")
    args = p.parse_args(argv)
    prompts = json.loads(Path(args.prompts).read_text())["prompts"]
    print("CPU flags:", " ".join(cpu_features().get("cpu_flags") or []), file=sys.stderr)
    no_cache = ("--no-prefix-cache",)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as scratch:
        versions = {"hybrid-old": hybrid_at(args.old, Path(scratch), args.old_file), "hybrid-new": HybridDraftSource}
        workers = dict(stack.enter_context(local_workers(
            [LocalWorkerSpec("verifier", args.target_model, extra_args=no_cache),
             LocalWorkerSpec("drafter", args.draft_model, extra_args=(*no_cache, "--requantize", "auto"))],
            one_at_a_time=True)))
        suffix = LocalWorkerSpec("drafter", args.target_model, "cpu", "auto", extra_args=("--method", "suffix"))
        base = stack.enter_context(Coordinator(verifier=workers["verifier"]))
        coordinators = {"target-only": base}
        if args.fixed_k:
            coordinators[f"k={args.fixed_k}"] = stack.enter_context(Coordinator(
                verifier=workers["verifier"], drafter=workers["drafter"], tokenizer=base.tokenizer))
        for name in versions:
            coordinators[name] = stack.enter_context(Coordinator(
                verifier=workers["verifier"], drafter=workers["drafter"], tokenizer=base.tokenizer,
                suffix_drafter=stack.enter_context(local_workers([suffix]))["drafter"]))
        modes = list(coordinators)
        for name in versions:  # each version learns on its own (one shared file would mix their measurements)
            store = Path(scratch) / f"{name}-learned.json"
            if args.learned:
                shutil.copyfile(args.learned, store)
            coordinators[name].learning = SourceLearning(store=store)

        def generate(mode: str, prompt_ids: list[int], max_new_tokens: int):
            # The loop builds its drafter through coordinator.api's name for the class: this mode's version.
            coordinator.api.HybridDraftSource = versions.get(mode, HybridDraftSource)
            draft_tokens = 0 if mode == "target-only" else (args.fixed_k if mode.startswith("k=") else None)
            try:
                return coordinators[mode].generate(prompt_ids, GenerationOptions(max_new_tokens=max_new_tokens,
                                                                                 draft_tokens=draft_tokens))
            finally:
                coordinator.api.HybridDraftSource = HybridDraftSource
        warm = base.encode_prompt("Hello", chat=True)
        for mode in modes:  # warm every worker, channel and cache, as coordinator bench does
            generate(mode, list(warm), 8)
        rows, differed = [], set()
        for i, prompt in enumerate(prompts):
            ids = base.encode_prompt(prompt["prompt"], chat=True)
            results = {}
            for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
                result = results[mode] = generate(mode, list(ids), args.max_new_tokens)
                rows.append({"id": prompt["id"], "class": prompt["class"], "mode": mode,
                             "new_tokens": result.stats["new_tokens"], "elapsed_s": result.stats["elapsed_s"],
                             "tokens_per_s": result.stats["tokens_per_s"], "rounds": rounds_of(result)})
                print(f"{prompt['id']:24} {mode:12} {result.stats['tokens_per_s']:6.2f} tok/s", file=sys.stderr)
            differed.update(m for m, r in results.items() if r.token_ids != results["target-only"].token_ids)
            if args.json:
                Path(args.json).write_text(json.dumps({"old": args.old_file or args.old, "rows": rows}, indent=1))
    print(summary(rows, modes))
    print("output differing from target-only's:", ", ".join(sorted(differed)) or "none")
    return 1 if differed else 0


if __name__ == "__main__":
    sys.exit(main())

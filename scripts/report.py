"""Summarise a `--record` file: a table of generations and speculation figures, and a PNG plot of the acceptance
rate per draft position and the tokens committed per round.

    python scripts/report.py run.jsonl [--plot report.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path


def load(path: Path) -> list[dict]:
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{number}: not a JSON line: {e}")
    if not entries:
        raise SystemExit(f"{path}: no generations recorded")
    return entries


def summarise(entries: list[dict]) -> dict:
    rounds = [r for e in entries for r in e["rounds"]]
    drafted = sum(r["drafted"] for r in rounds)
    accepted = sum(r["accepted"] for r in rounds)
    drafts = sum(1 for r in rounds if r["drafted"])
    tokens = sum(len(e["token_ids"]) for e in entries)
    seconds = sum(e["stats"]["elapsed_s"] for e in entries)
    per_position_drafted: Counter = Counter()
    per_position_accepted: Counter = Counter()
    for r in rounds:
        for position in range(r["drafted"]):
            per_position_drafted[position] += 1
            per_position_accepted[position] += position < r["accepted"]
    return {
        "generations": len(entries),
        "finish_reasons": dict(Counter(e["finish_reason"] for e in entries)),
        "new_tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "rounds": len(rounds),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "tokens_per_round": tokens / len(rounds) if rounds else 0.0,
        "median_latency_s": statistics.median(e["stats"]["elapsed_s"] for e in entries),
        "failovers": sum(e["stats"].get("failovers", 0) for e in entries),
        "acceptance_per_position": {p: per_position_accepted[p] / per_position_drafted[p]
                                    for p in sorted(per_position_drafted)},
        "tokens_per_round_histogram": dict(sorted(Counter(r["accepted"] + 1 for r in rounds).items())),
    }


def table(entries: list[dict], summary: dict) -> str:
    lines = ["| # | finish | new tokens | tokens/s | rounds | acceptance rate | prompt |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, e in enumerate(entries):
        s = e["stats"]
        rate = "-" if s.get("acceptance_rate") is None else f"{s['acceptance_rate']:.1%}"
        prompt = (e.get("prompt") or f"{len(e['prompt_ids'])} token ids").replace("\n", " ")[:40]
        lines.append(f"| {i} | {e['finish_reason']} | {s['new_tokens']} | {s['tokens_per_s']:.2f} | {s['rounds']} | "
                     f"{rate} | {prompt} |")
    rate = summary["acceptance_rate"]
    lines += ["", f"generations: {summary['generations']} {summary['finish_reasons']}",
              f"new tokens: {summary['new_tokens']} at {summary['tokens_per_s']:.2f} tokens/s",
              f"acceptance rate: {'n/a' if rate is None else f'{rate:.1%}'}; mean acceptance length "
              f"{summary['mean_acceptance_length']:.2f}; tokens per round {summary['tokens_per_round']:.2f}",
              "acceptance per draft position: " + ", ".join(
                  f"{p}: {r:.0%}" for p, r in summary["acceptance_per_position"].items())]
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    positions = list(summary["acceptance_per_position"])
    left.bar([p + 1 for p in positions], [summary["acceptance_per_position"][p] for p in positions])
    left.set(title="acceptance rate per draft position", xlabel="draft position", ylabel="accepted", ylim=(0, 1))
    hist = summary["tokens_per_round_histogram"]
    right.bar(list(hist), list(hist.values()))
    right.set(title="tokens committed per round", xlabel="tokens", ylabel="rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", type=Path, help="a JSONL file written by --record")
    parser.add_argument("--plot", type=Path, default=None, help="PNG to write (default: RECORD with .png)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    args = parser.parse_args(argv)
    entries = load(args.record)
    summary = summarise(entries)
    print(json.dumps(summary, indent=1) if args.json else table(entries, summary))
    plot(summary, args.plot or args.record.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

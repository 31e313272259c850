"""The benchmark's reports: a markdown summary (tables per class and mode, per-round breakdown, per-prompt speedups)
and a PNG plot of the speedup per prompt (needs matplotlib); and the results page (docs/benchmarks.md): a section per
saved report (name, machine, date, command, then the same tables), spliced in after MARKER."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from specmesh_bench.modes import BASELINE, ENGINE_BASELINES


def _f(value, fmt: str, missing: str = "–") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _x(value) -> str:
    return "–" if value is None else f"{value:.2f}x"


def sweep_markdown(report: dict) -> str:
    """A --threads sweep: tokens/s of every class and mode across the thread counts, then each run's own report."""
    runs = report["sweep"]
    counts = [r["config"]["threads"] for r in runs]
    lines = ["tokens/s by thread count (each count is a full run: workers and baselines restarted with that many "
             "threads; in brackets the speedup over that run's HF target-only):", "",
             "| class | mode | " + " | ".join(f"{n} threads" for n in counts) + " |",
             "| --- | --- |" + " ---: |" * len(counts)]
    cells = {(s["class"], s["mode"], r["config"]["threads"]): s for r in runs for s in r["summary"]}
    for s in runs[0]["summary"]:
        row = []
        for n in counts:
            cell = cells.get((s["class"], s["mode"], n))
            row.append("–" if cell is None else
                       f"{_f(cell['tokens_per_s'], '.2f')} ({_x(cell.get('speedup_vs_hf_target'))})")
        lines.append(f"| {s['class']} | {s['mode']} | " + " | ".join(row) + " |")
    for run in runs:
        lines += ["", f"### {run['config']['threads']} threads", "", markdown(run)]
    return "\n".join(lines) + "\n"


def engine_columns(modes: set[str]) -> list[tuple[str, str]]:
    """(row key, title) of each engine's own loop that ran: a speedup column each."""
    return [(key, title) for mode, key, title in ENGINE_BASELINES if mode in modes]


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
    engines = engine_columns({s["mode"] for s in summary})
    lines += ["| class | mode | tokens/s | speedup vs target-only | vs HF target-only | "
              + "".join(f"{title} | " for _key, title in engines)
              + "acceptance rate | mean accepted length | rounds | first divergence |",
              "| --- | --- | ---: | ---: | ---: |" + " ---: |" * len(engines) + " ---: | ---: | ---: | --- |"]
    for s in summary:
        div = f"{s['diverged_prompts']}/{s['prompts']} prompts, earliest token {s['earliest_divergence']}" \
            if s["diverged_prompts"] else "none"
        lines.append(f"| {s['class']} | {s['mode']} | {_f(s['tokens_per_s'], '.2f')} | {_x(s['speedup'])} | "
                     f"{_x(s['speedup_vs_hf_target'])} | "
                     + "".join(f"{_x(s.get(key))} | " for key, _title in engines)
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
    lines += per_step_table(summary, engines)
    modes = [m for m in report["config"]["modes"] if m != BASELINE]
    lines += ["", "Speedup over specmesh target-only per prompt:", "",
              "| prompt | class | " + " | ".join(modes) + " |", "| --- | --- |" + " ---: |" * len(modes)]
    by = {(r["prompt_id"], r["mode"]): r for r in rows}
    for p in report["prompts"]:
        cells = [_x(by[(p["id"], m)]["speedup"]) if (p["id"], m) in by else "–" for m in modes]
        lines.append(f"| {p['id']} | {p['class']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def per_step_table(summary: list[dict], engines: list[tuple[str, str]]) -> list[str]:
    """Time to the first token and the rate after it, against each engine's own loop: a per-step overhead shows in
    the second, a slower prefill only in the first. Empty for reports without first-token times (older JSON)."""
    if not engines or not any(s.get("first_token_ms") is not None for s in summary):
        return []
    lines = ["", "After the first token (the decode rate, prefill left out) and time to the first token, against "
             "each engine's own loop on the same prompts:", "",
             "| class | mode | first token ms | " + "".join(f"decode {title} | " for _key, title in engines),
             "| --- | --- | ---: |" + " ---: |" * len(engines)]
    for s in summary:
        if s.get("first_token_ms") is None:
            continue
        lines.append(f"| {s['class']} | {s['mode']} | {_f(s['first_token_ms'], '.0f')} | "
                     + "".join(f"{_x(s.get(f'decode_{key}'))} | " for key, _title in engines))
    return lines


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
        builds = [f"{role} {info[key]}" for role, key in (("verifier", "verifier_engine_build"),
                                                           ("drafter", "drafter_engine_build")) if info.get(key)]
        if builds:
            lines.append(f"- engine builds: {'; '.join(builds)}.")
        if info.get("draft_tokenizer") == "translated":
            lines.append("- the draft model's tokenizer is not the target's: its drafts are translated through text "
                         "(coordinator/translation.py).")
        if "ik" in (info.get("verifier_engine"), info.get("drafter_engine")):
            lines.append("- ik_llama.cpp runs every session in a KV context of its own, where its k-token pass is "
                         "bit-identical to one-token decoding: the first divergence column must read none.")
        if "llamacpp" in (info.get("verifier_engine"), info.get("drafter_engine")):
            lines.append("- llama.cpp's batched evaluation is not bit-identical to its one-token evaluation: the first "
                         "divergence column (against this run's target-only) is the exactness report.")
    cpu = info.get("cpu")
    if cpu:
        text = (f"- CPU: {cpu['cpu_model'] + ', ' if cpu.get('cpu_model') else ''}{cpu.get('cpu_count')} cores, "
                f"flags {' '.join(cpu.get('cpu_flags') or []) or '(none)'}")
        if cpu.get("torch_cpu_capability"):
            text += f"; torch kernels {cpu['torch_cpu_capability']}"
        if cpu.get("llamacpp_cpu_features") is not None:
            text += f"; llama.cpp build {' '.join(cpu['llamacpp_cpu_features']) or '(none of these)'}"
        lines.append(text + (f"; threads {config['threads']}" if config.get("threads") else "") + ".")
    pages = info.get("huge_pages")
    if pages:
        on = {True: "on", False: "off"}
        lines.append(f"- Huge pages (glibc.malloc.hugetlb=1): workers {on[pages['workers']]}, in-process baselines "
                     f"{on[pages['baselines']]}; THP mode {pages.get('thp_mode') or 'absent'} "
                     "([engines.md](engines.md#huge-pages)).")
    for role, memory in (info.get("memory") or {}).items():
        if memory.get("weights_bytes"):
            lines.append(f"- {role} memory after the run: {memory['resident_bytes'] / 2**30:.2f} GiB resident, weights "
                         f"{memory['weights_bytes'] / 2**30:.2f} GiB "
                         f"({memory['resident_bytes'] / memory['weights_bytes']:.2f}x).")
    if info.get("hf_dtype"):
        lines.append(f"- HF transformers baselines: {info['hf_dtype']}.")
    if config.get("order") == "interleaved":
        lines.append("- order: interleaved (every prompt ran every mode back to back, each prompt starting one mode "
                     "later).")
    elif config.get("order") == "phased":
        lines.append("- order: phased (all specmesh modes, then each baseline side in turn).")
    llama = info.get("llamacpp")
    if llama:
        lookup = llama.get("prompt_lookup")
        build = llama.get("build")
        lines.append(f"- llama.cpp baselines: llama-cpp-python {llama.get('version')}"
                     + (f" (built with {' '.join(f'{k}={v}' for k, v in build.items())}; extra CPU buffer types "
                        "off where AMX is)" if build else "")
                     + f", {llama.get('threads')} "
                     f"threads, flash attention {'on' if llama.get('flash_attn') else 'off'}, "
                     f"{Path(llama.get('gguf') or '').name}"
                     + (f"; llama-lookup: num_pred_tokens {lookup['num_pred_tokens']}, max_ngram_size "
                        f"{lookup['max_ngram_size']}" if lookup else "") + ".")
    ik = info.get("ik")
    if ik:
        lines.append(f"- ik_llama.cpp baseline: {ik.get('build') or ik.get('package') + ' ' + str(ik.get('version'))}, "
                     f"{ik.get('threads')} threads, flash attention off, {Path(ik.get('gguf') or '').name}; its own "
                     "one-token C-API loop.")
    curves = {name: curve for name, curve in (("ik_llama.cpp", (ik or {}).get("verify_curve")),
                                              ("verifier (Info.verify_costs)", info.get("verify_curve"))) if curve}
    for name, curve in curves.items():
        lines.append(f"- v(n) of {name}, one decode of n tokens over one token: "
                     + ", ".join(f"{k} {v}" for k, v in curve.items()) + ".")
    for mode, reason in (report.get("skipped_modes") or {}).items():
        lines.append(f"- skipped {mode}: {reason}.")
    return lines + [""] if lines else []


def report_markdown(report: dict) -> str:
    """The tables of any saved report, as the bench prints them: local, --threads sweep or --topology split."""
    if report.get("topology") == "split":
        return split_markdown(report)
    return sweep_markdown(report) if "sweep" in report else markdown(report)


# The line in a results page (docs/benchmarks.md) after which everything is generated: `coordinator bench --from-json
# docs/results/*.json --markdown docs/benchmarks.md` keeps the page up to and including this line and rewrites the rest.
MARKER = "<!-- generated results below: do not edit by hand -->"


def result_section(name: str, report: dict) -> str:
    """One saved report on a results page: a heading with its name, machine and date, the command that ran it and the
    specmesh revision, then report_markdown's tables."""
    run = report.get("run") or {}
    machine = run.get("machine") or (report.get("info") or {}).get("cpu") or {}
    cores = machine.get("usable_cpus") or machine.get("cpu_count")
    where = ", ".join(part for part in (machine.get("cpu_model"), f"{cores} cores" if cores else None,
                                        f"{machine['memory_gib']:g} GiB" if machine.get("memory_gib") else None)
                      if part) or "machine not recorded"
    date = (run.get("date") or "date not recorded").replace("T", " ").replace("+00:00", " UTC")
    lines = [f"## {name}: {where}, {date}", ""]
    if run.get("command"):
        lines += ["```sh", run["command"], "```", ""]
    facts = []
    revision = run.get("specmesh_revision")
    if revision:
        facts.append(f"specmesh {revision['commit'][:12]}" + (" with local changes" if revision.get("dirty") else ""))
    for key, label in (("os", None), ("python", "Python"), ("torch", "torch")):
        if machine.get(key):
            facts.append(f"{label} {machine[key]}" if label else machine[key])
    start, end = run.get("load_average"), run.get("load_average_end")
    load = [f"{start[0]:g} at the start" if start else None, f"{end[0]:g} at the end" if end else None]
    if any(load):  # a busy host makes noisy numbers
        facts.append("load average (1 min) " + ", ".join(part for part in load if part)
                     + (f" on {cores} cores" if cores else ""))
    if facts:
        lines += ["Ran on " + "; ".join(facts) + ".", ""]
    return "\n".join(lines) + "\n" + report_markdown(report)


def results_markdown(reports: list[tuple[str, dict]]) -> str:
    """The generated part of a results page: a section per (name, report), in the order given."""
    return "\n".join(result_section(name, report) for name, report in reports)


def _marker_line(lines: list[str]) -> int | None:
    return next((i for i, line in enumerate(lines) if line.strip() == MARKER), None)


def splice(page: str, generated: str) -> str:
    """The results page with everything after its MARKER line replaced by a blank line and generated (ValueError: the
    page has no marker line)."""
    lines = page.splitlines(keepends=True)
    at = _marker_line(lines)
    if at is None:
        raise ValueError(f"it has no line {MARKER!r}")
    head = "".join(lines[:at + 1])
    return head + ("" if head.endswith("\n") else "\n") + "\n" + generated


def generated_part(page: str) -> str | None:
    """What follows a results page's MARKER line (and the blank line splice puts after it); None: no marker line."""
    lines = page.splitlines(keepends=True)
    at = _marker_line(lines)
    if at is None:
        return None
    rest = "".join(lines[at + 1:])
    return rest[1:] if rest.startswith("\n") else rest


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


def split_markdown(report: dict) -> str:
    """The split-host sweep: per round trip and mode (all prompts), tokens/s, speedups over target-only at the same
    round trip and over the in-process baselines on the verifier's core, acceptance and time per round."""
    info, config = report["info"], report["config"]
    method = {"netem": "tc netem on every host's egress",
              "relay": "a user-space relay holding every byte for the delay (no netem in this kernel)"}
    lines = [f"**{info.get('draft') or '(no draft model)'} → {info['target']}**, {info['dtype']} on {info['device']}, "
             f"greedy, ≤ {config['max_new_tokens']} new tokens, {len(report['prompts'])} prompts "
             f"({', '.join(f'{n} {c}' for c, n in report['prompt_counts'].items())}), best of {config['repeats']}.",
             "",
             f"- split hosts: drafter, verifier and coordinator each in its own network namespace; drafter pinned to "
             f"CPU {config['drafter_cpu']}, verifier to CPU {config['verifier_cpu']}, {config['threads']} thread(s) "
             f"each; link delay by {method.get(config['link_delay'], config['link_delay'])}.",
             f"- baselines (HF / llama.cpp target-only) in-process on the verifier's CPU {config['verifier_cpu']} with "
             f"{config['threads']} thread(s), no network.",
             *header_notes(report)]
    engines = engine_columns({r["mode"] for r in report.get("baseline_rows", [])})
    lines += ["| one-way delay ms | RTT ms | measured RTT ms | mode | tokens/s | vs target-only (same RTT) | "
              "vs HF target-only | " + "".join(f"{title} | " for _key, title in engines)
              + "acceptance | tokens/round | ms/round | draft ms/round | verify ms/round |",
              "| ---: | ---: | ---: | --- | ---: | ---: | ---: |" + " ---: |" * len(engines)
              + " ---: | ---: | ---: | ---: | ---: |"]
    first = True
    for run in report["runs"]:
        for s in run["summary"]:
            if s["class"] != "all" or (s["kind"] != "specmesh" and not first):
                continue
            network = s["kind"] == "specmesh"
            ms_round = (s["draft_ms_per_round"] + s["verify_ms_per_round"] + s["rest_ms_per_round"]) if network \
                else None
            lines.append(
                f"| {_f(run['one_way_delay_ms'], 'g') if network else '–'} | "
                f"{_f(run['rtt_ms'], 'g') if network else '–'} | "
                f"{_f(run.get('measured_rtt_ms'), '.1f') if network else '–'} | {s['mode']} | "
                f"{_f(s['tokens_per_s'], '.2f')} | {_x(s['speedup']) if network else '–'} | "
                f"{_x(s['speedup_vs_hf_target'])} | "
                + "".join(f"{_x(s.get(key))} | " for key, _title in engines)
                + f"{_f(s['acceptance_rate'], '.1%')} | {_f(s['mean_accepted_length'], '.2f')} | "
                f"{_f(ms_round, '.1f')} | {_f(s.get('draft_ms_per_round'), '.1f')} | "
                f"{_f(s.get('verify_ms_per_round'), '.1f')} |")
        first = False
    classes = [c for c in report["prompt_counts"]]
    if len(classes) > 1:
        specmesh = {s["mode"] for s in report["runs"][0]["summary"] if s["kind"] == "specmesh"}
        modes = [m for m in config["modes"] if m != BASELINE and m in specmesh]
        lines += ["", "Speedup over target-only at the same round trip, by class:", "",
                  "| RTT ms | class | " + " | ".join(modes) + " |", "| ---: | --- |" + " ---: |" * len(modes)]
        for run in report["runs"]:
            by = {(s["class"], s["mode"]): s for s in run["summary"]}
            for c in classes:
                cells = [_x((by.get((c, m)) or {}).get("speedup")) for m in modes]
                lines.append(f"| {_f(run['rtt_ms'], 'g')} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def split_plot(report: dict, path: Path) -> bool:
    """Tokens/s and time per round against the round trip, one line per specmesh mode; the in-process baselines as
    horizontal lines."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    runs = report["runs"]
    rtts = [run["rtt_ms"] for run in runs]
    fig, (tps, per_round) = plt.subplots(1, 2, figsize=(11, 4.5))
    modes = [s["mode"] for s in runs[0]["summary"] if s["class"] == "all" and s["kind"] == "specmesh"]
    for mode in modes:
        cells = [next((s for s in run["summary"] if s["class"] == "all" and s["mode"] == mode), {}) for run in runs]
        tps.plot(rtts, [c.get("tokens_per_s") or 0.0 for c in cells], marker="o", label=mode)
        per_round.plot(rtts, [(c.get("draft_ms_per_round") or 0.0) + (c.get("verify_ms_per_round") or 0.0)
                              + (c.get("rest_ms_per_round") or 0.0) for c in cells], marker="o", label=mode)
    for s in runs[0]["summary"]:
        if s["class"] == "all" and s["kind"] != "specmesh" and s["tokens_per_s"]:
            tps.axhline(s["tokens_per_s"], linestyle="--", linewidth=1, color="gray")
            tps.annotate(f"{s['mode']} (verifier's core)", (rtts[0], s["tokens_per_s"]), fontsize=7,
                         textcoords="offset points", xytext=(2, 3))
    tps.set_xlabel("round trip, ms")
    tps.set_ylabel("tokens/s (all prompts)")
    per_round.set_xlabel("round trip, ms")
    per_round.set_ylabel("ms per round")
    info = report["info"]
    fig.suptitle(f"split hosts: {info.get('draft') or ''} → {info['target']} ({info['dtype']}), "
                 f"link delay by {report['config']['link_delay']}", fontsize=9)
    tps.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

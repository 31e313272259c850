"""Benchmark results are generated, not copied: every committed docs/results/*.json says where it came from (machine,
engines, command, date) and docs/benchmarks.md's part after the marker line is exactly what the bench's own renderer
makes of them (`make docs-results`). Plus `--markdown` on small synthetic reports: the same tables the bench prints,
results pages spliced after their marker and nowhere else, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specmesh_bench import bench
from specmesh_bench.bench import load_report, main, render_results
from specmesh_bench.machine import run_record
from specmesh_bench.reports import MARKER, generated_part, report_markdown, splice

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.json"))
PAGE = ROOT / "docs" / "benchmarks.md"
RERENDER = "make docs-results (coordinator bench --from-json docs/results/*.json --markdown docs/benchmarks.md)"


def test_there_are_committed_results():
    assert RESULTS, "docs/results/ holds no saved bench report"


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_each_committed_result_says_where_it_came_from(path):
    report = json.loads(path.read_text())
    run = report["run"]
    assert run["command"].startswith("coordinator bench") and isinstance(run["argv"], list)
    assert run["date"][:4].isdigit() and "T" in run["date"]
    machine = run["machine"]
    assert machine["cpu_model"] and machine["cpu_count"] >= 1 and isinstance(machine["cpu_flags"], list)
    runs = report.get("sweep", [report]) if report.get("topology") != "split" else [report]
    for each in runs:
        assert each["config"]["engines"] and each["config"]["resolved_engines"]
        assert each["info"]["verifier_engine"]


def test_the_committed_tables_are_the_rendering_of_the_committed_json():
    page = PAGE.read_text()
    generated = generated_part(page)
    assert generated is not None, f"docs/benchmarks.md has no line {MARKER}"
    # Not a per-line diff: the first differing line is enough to say which result went stale.
    expected = render_results(RESULTS)
    if generated != expected:
        got, want = generated.splitlines(), expected.splitlines()
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        pytest.fail(f"docs/benchmarks.md's generated part differs from its JSON at generated line {at + 1}:\n"
                    f"  committed: {got[at] if at < len(got) else '(end)'}\n"
                    f"  rendered:  {want[at] if at < len(want) else '(end)'}\n"
                    f"re-render with {RERENDER}; never edit the tables by hand")


# ---- --markdown on synthetic reports -------------------------------------------------------------------------------

def row(prompt_id: str, cls: str, mode: str, kind: str, tokens_per_s: float, token_ids: list[int], rounds: int,
        drafted: int | None = None, accepted: int | None = None) -> dict:
    elapsed = len(token_ids) / tokens_per_s
    return {"prompt_id": prompt_id, "class": cls, "mode": mode, "kind": kind, "tokens_per_s": tokens_per_s,
            "token_ids": token_ids, "new_tokens": len(token_ids), "elapsed_s": elapsed, "rounds": rounds,
            "drafted_tokens": drafted, "accepted_tokens": accepted, "draft_s": 0.1 * elapsed,
            "verify_s": 0.8 * elapsed, "rest_s": 0.1 * elapsed,
            "first_round": {"draft_s": 0.01, "verify_s": 0.05},
            "steady": {"rounds": rounds - 1, "verify_s": 0.7 * elapsed, "draft_s": 0.1 * elapsed,
                       "drafted": max((drafted or 0) - 1, 0)}}


def synthetic_report(target: str = "tiny-target", date: str = "2026-01-02T03:04:05+00:00") -> dict:
    rows = [row("c1", "code", "target-only", "specmesh", 10.0, [1, 2, 3, 4], 4),
            row("c1", "code", "adaptive", "specmesh", 15.0, [1, 2, 3, 4], 2, drafted=4, accepted=3),
            row("p1", "prose", "target-only", "specmesh", 12.0, [5, 6, 7], 3),
            row("p1", "prose", "adaptive", "specmesh", 11.0, [5, 6, 8], 3, drafted=3, accepted=1)]
    return {
        "run": {"argv": ["--modes", "target-only,adaptive", "--json", "x.json"],
                "command": "coordinator bench --modes target-only,adaptive --json x.json", "date": date,
                "specmesh_revision": {"commit": "0123456789abcdef" * 2 + "01234567", "dirty": False},
                "load_average": [0.5, 0.4, 0.3], "load_average_end": [1.25, 0.5, 0.3],
                "machine": {"cpu_model": "Synthetic CPU 9000", "cpu_flags": ["avx2"], "cpu_count": 4,
                            "usable_cpus": 2, "memory_gib": 8.0, "os": "Linux-test", "python": "3.11.0",
                            "torch": "2.0"}},
        "info": {"target": target, "draft": "tiny-draft", "dtype": "float32", "device": "cpu",
                 "verifier_engine": "transformers", "drafter_engine": "transformers",
                 "cpu": {"cpu_model": "Synthetic CPU 9000", "cpu_flags": ["avx2"], "cpu_count": 4}},
        "config": {"max_new_tokens": 4, "modes": ["target-only", "adaptive"], "classes": ["code", "prose"],
                   "repeats": 1, "ngram_min": 1, "ngram_max": 3, "threads": None, "order": "interleaved",
                   "engines": {"target": "transformers", "draft": "transformers"},
                   "resolved_engines": {"target": "transformers", "draft": "transformers"}},
        "skipped_modes": {},
        "prompts": [{"id": "c1", "class": "code", "prompt_tokens": 9}, {"id": "p1", "class": "prose",
                                                                         "prompt_tokens": 7}],
        "prompt_counts": {"code": 1, "prose": 1},
        "rows": rows,
    }


def save(path: Path, report: dict) -> Path:
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def test_markdown_of_one_report_is_what_the_bench_prints(tmp_path, capsys):
    saved = save(tmp_path / "one.json", synthetic_report())
    out = tmp_path / "one.md"
    assert main(["--from-json", str(saved), "--markdown", str(out)]) == 0
    text = out.read_text()
    assert capsys.readouterr().out == "\n" + text + "\n"  # the same renderer: printed and written
    assert text == report_markdown(load_report(saved))
    assert "**tiny-draft → tiny-target**" in text and "| code | adaptive | 15.00 | 1.50x |" in text
    assert "- CPU: Synthetic CPU 9000, 4 cores, flags avx2." in text
    assert "| prose | adaptive |" in text and "1/1 prompts, earliest token 2" in text


def test_several_reports_make_a_section_each_sorted_by_name(tmp_path):
    b = save(tmp_path / "b-run.json", synthetic_report("target-b", "2026-02-01T00:00:00+00:00"))
    a = save(tmp_path / "a-run.json", synthetic_report("target-a"))
    out = tmp_path / "results.md"
    assert main(["--from-json", str(b), str(a), "--markdown", str(out)]) == 0
    text = out.read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## a-run: Synthetic CPU 9000, 2 cores, 8 GiB, 2026-01-02 03:04:05 UTC",
                        "## b-run: Synthetic CPU 9000, 2 cores, 8 GiB, 2026-02-01 00:00:00 UTC"]
    assert text.count("```sh\ncoordinator bench --modes target-only,adaptive --json x.json\n```") == 2
    assert ("Ran on specmesh 0123456789ab; Linux-test; Python 3.11.0; torch 2.0; load average (1 min) 0.5 at the "
            "start, 1.25 at the end on 2 cores." in text)
    assert text.index("target-a") < text.index("target-b")
    assert text == render_results([a, b]) and report_markdown(load_report(a)) in text


def test_a_results_page_keeps_its_prose_and_gets_only_the_generated_part_rewritten(tmp_path):
    saved = [save(tmp_path / "r1.json", synthetic_report()), save(tmp_path / "r2.json", synthetic_report("t2"))]
    prose = "# Benchmarks\n\nHow to read them: ratios, not absolute numbers.\n\n" + MARKER + "\n"
    page = tmp_path / "benchmarks.md"
    page.write_text(prose + "\n| stale | hand-edited table |\n")
    argv = ["--from-json", *map(str, saved), "--markdown", str(page)]
    assert main(argv) == 0
    text = page.read_text()
    assert text.startswith(prose) and "stale" not in text
    assert generated_part(text) == render_results(saved)
    assert main(argv) == 0 and page.read_text() == text  # idempotent
    # A hand edit of a table is what the docs test catches.
    edited = text.replace("| code | adaptive | 15.00 |", "| code | adaptive | 25.00 |")
    assert edited != text and generated_part(edited) != render_results(saved)
    # One report into a results page: still a section (with its heading), still after the marker only.
    assert main(["--from-json", str(saved[0]), "--markdown", str(page)]) == 0
    assert page.read_text() == prose + "\n" + render_results(saved[:1])


def test_splice_and_generated_part_round_trip():
    page = "# Title\n" + MARKER + "\nold\n"
    assert splice(page, "new\n") == "# Title\n" + MARKER + "\n\nnew\n"
    assert generated_part(splice(page, "new\n")) == "new\n"
    assert generated_part("# no marker\n") is None
    with pytest.raises(ValueError):
        splice("# no marker\n", "x")
    assert splice("# Title\n" + MARKER, "x\n") == "# Title\n" + MARKER + "\n\nx\n"


def test_refusals_exit_2(tmp_path, capsys):
    one, two = save(tmp_path / "1.json", synthetic_report()), save(tmp_path / "2.json", synthetic_report())
    assert main(["--from-json", str(one), str(two)]) == 2
    assert main(["--from-json", str(one), str(two), "--markdown", str(tmp_path / "x.md"), "--json",
                 str(tmp_path / "y.json")]) == 2
    assert main(["--from-json", str(tmp_path / "missing.json"), str(one), "--markdown", str(tmp_path / "x.md")]) == 2
    page = tmp_path / "page.md"
    page.write_text(f"# Benchmarks\n{MARKER}\n")
    # A live run never overwrites a results page (it would drop every other result): refused before anything starts.
    assert main(["--markdown", str(page), "--limit-prompts", "1"]) == 2
    assert "results page" in capsys.readouterr().err and page.read_text() == f"# Benchmarks\n{MARKER}\n"


def test_a_live_run_records_its_command_date_revision_and_machine(tmp_path, monkeypatch):
    """run() around a stubbed measurement: the JSON gets the "run" record; the markdown is the printed report."""
    measured = synthetic_report()
    del measured["run"]
    measured = load_report(save(tmp_path / "measured.json", measured))  # with its summary, as measure() returns it
    monkeypatch.setattr(bench, "measure", lambda *args, **kwargs: measured)
    argv = ["--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2", "--engine", "transformers",
            "--modes", "target-only,adaptive", "--classes", "code", "--limit-prompts", "1",
            "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")]
    assert main(argv, prog="coordinator bench") == 0
    report = json.loads((tmp_path / "r.json").read_text())
    run = report["run"]
    assert run["argv"] == argv and run["command"].startswith("coordinator bench --target-model tiny-random-qwen2")
    assert run["machine"]["cpu_count"] >= 1 and "cpu_flags" in run["machine"] and "cpu_model" in run["machine"]
    assert run["date"].endswith("+00:00")
    assert all(len(run[key]) == 3 for key in ("load_average", "load_average_end"))
    assert (tmp_path / "r.md").read_text() == report_markdown(load_report(tmp_path / "r.json"))


def test_run_record_quotes_the_command_line():
    record = run_record("coordinator bench", ["--modes", "target-only,adaptive", "--prompt-ids", "a b"])
    assert record["command"] == "coordinator bench --modes target-only,adaptive --prompt-ids 'a b'"
    assert set(record["machine"]) >= {"cpu_model", "cpu_flags", "cpu_count", "usable_cpus", "memory_gib", "os"}
    revision = record["specmesh_revision"]
    assert revision is None or (len(revision["commit"]) == 40 and isinstance(revision["dirty"], bool))

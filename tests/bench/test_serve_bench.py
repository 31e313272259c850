"""`coordinator bench-serve` (specmesh_bench/serve_bench.py): its flags, the workload file, the report's
aggregation on made-up rows, and one end-to-end run on the tiny models. Speed is never asserted: the bench measures
it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from specmesh_bench import serve_bench
from specmesh_bench.serve_bench import (DEFAULT_WORKLOAD, MODES, aggregate, build_parser, load_workload,
                                                main, mark_reference, markdown, parse_modes, rotated,
                                                select_conversations, serve_arguments, summarize, worker_specs,
                                                workload_problems)
from coordinator.cli import BENCHMARK_COMMANDS, benchmark_module


# ---------------------------------------------------------------------------------------------- flags

def test_registered_as_a_coordinator_command():
    assert "bench-serve" in BENCHMARK_COMMANDS
    assert benchmark_module("bench-serve") is serve_bench


def test_parser_defaults():
    args = build_parser("coordinator bench-serve").parse_args([])
    assert parse_modes(args.modes) == ["target-only", "hybrid", "suffix", "ngram", "model"]
    assert args.max_tokens == 128 and args.workload == DEFAULT_WORKLOAD and args.draft_policy == "cost"
    assert args.classes is None and args.conversations_per_class is None and args.json is None
    assert args.engine == "auto" and args.threads is None and not args.no_prefix_cache


@pytest.mark.parametrize("modes", ["fastest", "target-only,target-only", ""])
def test_parse_modes_refuses_unknown_and_repeated_modes(modes):
    with pytest.raises(ValueError):
        parse_modes(modes)


@pytest.mark.parametrize("argv, says", [
    (["--modes", "target-only,eagle"], "unknown mode"),
    (["--classes", "poetry"], "unknown class"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--conversations-per-class", "0"], "--conversations-per-class must be at least 1"),
])
def test_bad_arguments_exit_2_before_anything_starts(argv, says, capsys):
    assert main(argv, prog="coordinator bench-serve") == 2
    assert says in capsys.readouterr().err


def test_bad_workload_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "w.json"
    bad.write_text(json.dumps({"conversations": [{"id": "a", "class": "edit", "turns": []}]}))
    assert main(["--workload", str(bad)], prog="coordinator bench-serve") == 2
    assert "needs a non-empty list 'turns'" in capsys.readouterr().err


def args_for(**overrides) -> argparse.Namespace:
    args = build_parser().parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_each_mode_gets_its_own_workers_and_server_flags(tmp_path):
    args = args_for(target_model="T", draft_model="D", threads=2)
    kinds = {mode: [(kind, spec.model, spec.extra_args) for kind, spec in worker_specs(args, mode)] for mode in MODES}
    assert kinds["target-only"] == [("verifier", "T", ())]
    assert kinds["model"] == [("verifier", "T", ()), ("drafter", "D", ())]
    assert kinds["hybrid"] == [("verifier", "T", ()), ("drafter", "D", ()),
                               ("suffix_drafter", "T", ("--method", "suffix"))]
    assert kinds["suffix"] == [("verifier", "T", ()), ("drafter", "T", ("--method", "suffix"))]
    assert kinds["ngram"] == [("verifier", "T", ()), ("drafter", "T", ("--method", "ngram"))]
    cacheless = worker_specs(args_for(no_prefix_cache=True), "model")
    assert all("--no-prefix-cache" in spec.extra_args for _, spec in cacheless)

    addresses = {"verifier": "v:1", "drafter": "d:2", "suffix_drafter": "s:3"}
    target_only = serve_arguments(args, "target-only", {"verifier": "v:1"}, tmp_path / "r")
    assert target_only[0] == "serve" and "--draft-tokens" in target_only and "--drafter" not in target_only
    hybrid = serve_arguments(args, "hybrid", addresses, tmp_path / "r")
    assert hybrid[hybrid.index("--drafter") + 1] == "d:2" and hybrid[hybrid.index("--suffix-drafter") + 1] == "s:3"
    assert hybrid[hybrid.index("--record") + 1] == str(tmp_path / "r")
    model = serve_arguments(args, "model", {"verifier": "v:1", "drafter": "d:2"}, tmp_path / "r")
    assert "--suffix-drafter" not in model and model[model.index("--draft-policy") + 1] == "cost"
    # The no-guess hybrid: the hybrid's workers, a server told not to guess; the hybrid's server guesses.
    assert kinds["hybrid-no-guesses"] == kinds["hybrid"]
    no_guesses = serve_arguments(args, "hybrid-no-guesses", addresses, tmp_path / "r")
    assert no_guesses == [*hybrid, "--no-stream-guesses"]
    # What the bench hands `coordinator serve` is a command line its real parser accepts.
    from coordinator.cli import build_parser as cli_parser
    assert cli_parser().parse_args(hybrid).suffix_drafter == ["s:3"]
    assert cli_parser().parse_args(hybrid).stream_guesses is True
    assert cli_parser().parse_args(no_guesses).stream_guesses is False
    # It runs only when asked for: the default modes are the five that were always there.
    assert build_parser().parse_args([]).modes.split(",") == ["target-only", "hybrid", "suffix", "ngram", "model"]


# ---------------------------------------------------------------------------------------------- the workload

def test_the_shipped_workload_has_every_class_with_roles_and_turns():
    conversations = load_workload(DEFAULT_WORKLOAD)
    by_class: dict[str, list[dict]] = {}
    for conversation in conversations:
        by_class.setdefault(conversation["class"], []).append(conversation)
        assert 4 <= len(conversation["turns"]) <= 5, conversation["id"]
        assert conversation["turns"][0]["role"] == "user"
        assert all(t["role"] in ("user", "tool") and t["content"].strip() for t in conversation["turns"])
    assert {c: len(v) for c, v in by_class.items()} == {"edit": 2, "tools": 2, "document": 2, "prose": 2}
    # tools: a tool schema in the system message, then tool results as JSON
    for conversation in by_class["tools"]:
        assert '"parameters"' in conversation["system"]
        assert all(t["role"] == "tool" and json.loads(t["content"])["tool"] for t in conversation["turns"][1:])
    # edit and document: the file or the document comes with the first turn
    assert all("```python" in c["turns"][0]["content"] for c in by_class["edit"])
    assert all(len(c["turns"][0]["content"]) > 3000 for c in by_class["document"])
    # not trivially repetitive: no turn is sent twice
    contents = [t["content"] for c in conversations for t in c["turns"]]
    assert len(set(contents)) == len(contents)


@pytest.mark.parametrize("data, problem", [
    ([], "non-empty list 'conversations'"),
    ({"conversations": []}, "non-empty list 'conversations'"),
    ({"conversations": [{"class": "edit", "turns": [{"role": "user", "content": "x"}]}]},
     "needs a non-empty string 'id'"),
    ({"conversations": [{"id": "a", "turns": [{"role": "user", "content": "x"}]}]}, "non-empty string 'class'"),
    ({"conversations": [{"id": "a", "class": "edit"}]}, "non-empty list 'turns'"),
    ({"conversations": [{"id": "a", "class": "edit", "turns": [{"content": "x"}]}]}, "turn 1: needs 'role'"),
    ({"conversations": [{"id": "a", "class": "edit", "turns": [{"role": "assistant", "content": "x"}]}]},
     "turn 1: needs 'role'"),
    ({"conversations": [{"id": "a", "class": "edit", "turns": [{"role": "user", "content": " "}]}]},
     "non-empty string 'content'"),
    ({"conversations": [{"id": "a", "class": "edit", "turns": [{"role": "tool", "content": "{}"}]}]},
     "first turn must be the user's"),
    ({"conversations": [{"id": "a", "class": "edit", "system": "", "turns": [{"role": "user", "content": "x"}]}]},
     "'system' must be a non-empty string"),
    ({"conversations": [{"id": "a", "class": "e", "turns": [{"role": "user", "content": "x"}]},
                        {"id": "a", "class": "e", "turns": [{"role": "user", "content": "y"}]}]}, "duplicate id"),
])
def test_workload_problems_are_named(data, problem):
    assert any(problem in p for p in workload_problems(data)), workload_problems(data)


def test_load_workload_refuses_what_is_not_json(tmp_path):
    path = tmp_path / "w.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read workload"):
        load_workload(path)


def test_selection_alternates_classes_and_cuts_conversations_and_turns():
    conversations = load_workload(DEFAULT_WORKLOAD)
    everything = select_conversations(conversations)
    assert [c["class"] for c in everything[:4]] == ["edit", "tools", "document", "prose"]
    assert len(everything) == 8 and everything[4]["class"] == "edit" and everything[4] is not everything[0]
    chosen = select_conversations(conversations, ["prose", "edit"], per_class=1, max_turns=2)
    assert [c["class"] for c in chosen] == ["prose", "edit"] and all(len(c["turns"]) == 2 for c in chosen)
    assert len(conversations[0]["turns"]) == 5  # the loaded conversations are left as they were
    with pytest.raises(ValueError, match="unknown class"):
        select_conversations(conversations, ["poetry"])


def test_modes_take_turns_at_going_first():
    modes = list(MODES)
    firsts = [rotated(modes, i)[0] for i in range(len(modes))]
    assert sorted(firsts) == sorted(modes)
    assert all(sorted(rotated(modes, i)) == sorted(modes) for i in range(7))


# ---------------------------------------------------------------------------------------------- aggregation

def row(conversation: str, cls: str, mode: str, turn: int, tokens: int, seconds: float, ttft: float,
        text: str = "same", drafted: int = 0, accepted: int = 0, rounds: int | None = None, prompt: str = "p",
        reused: int = 0) -> dict:
    return {"conversation": conversation, "class": cls, "mode": mode, "turn": turn, "position": 0,
            "prompt_tokens": 100 * turn, "completion_tokens": tokens, "ttft_s": ttft, "total_s": seconds,
            "tokens_per_s": tokens / seconds, "finish_reason": "length", "rounds": rounds or tokens,
            "drafted_rounds": None, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None, "tokens_per_round": None,
            "suffix_rounds": None, "model_rounds": None, "draft_s": None, "verify_s": None,
            "prefix_cache_hit": reused > 0, "prefix_reused_tokens": reused,
            "prompt_digest": f"{conversation}/{turn}/{prompt}", "text": text}


def synthetic_rows() -> list[dict]:
    """Two modes over one edit conversation (3 turns) and one prose conversation (2 turns). target-only: 10 tok/s
    everywhere, TTFT 1.0 s at turn 1 and 1.1 s after. hybrid: 20 tok/s on edit from turn 2 (10 on turn 1), 9.5 on
    prose; its edit turn 3 differs from target-only's, and so does its prose turn 2, but on another prompt."""
    rows = []
    for turn in (1, 2, 3):
        rows.append(row("e1", "edit", "target-only", turn, 100, 10.0, 1.0 if turn == 1 else 1.1, reused=0))
        rows.append(row("e1", "edit", "hybrid", turn, 100, 10.0 if turn == 1 else 5.0, 2.0 if turn == 1 else 1.0,
                        text="other" if turn == 3 else "same", drafted=80, accepted=60, rounds=40,
                        reused=0 if turn == 1 else 50 * turn))
    for turn in (1, 2):
        rows.append(row("p1", "prose", "target-only", turn, 95, 9.5, 0.5))
        rows.append(row("p1", "prose", "hybrid", turn, 95, 10.0, 0.5, drafted=10, accepted=0, rounds=95,
                        text="drift" if turn == 2 else "same", prompt="diverged" if turn == 2 else "p"))
    return rows


def test_mark_reference_sets_equality_flags():
    rows = synthetic_rows()
    mark_reference(rows)
    flags = {(r["conversation"], r["mode"], r["turn"]): (r["same_prompt"], r["same_text"]) for r in rows}
    assert flags[("e1", "hybrid", 1)] == (True, True) and flags[("e1", "hybrid", 3)] == (True, False)
    assert flags[("p1", "hybrid", 2)] == (False, False)  # another history: its text is not an exactness failure
    assert all(flags[(c, "target-only", t)] == (True, True) for c, _, t in flags)
    only_hybrid = [r for r in synthetic_rows() if r["mode"] == "hybrid"]
    mark_reference(only_hybrid)
    assert all(r["same_prompt"] is None and r["same_text"] is None for r in only_hybrid)


def test_aggregate_sums_tokens_and_seconds():
    rows = synthetic_rows()
    mark_reference(rows)
    agg = aggregate([r for r in rows if r["mode"] == "hybrid" and r["class"] == "edit"])
    assert agg["tokens_per_s"] == pytest.approx(300 / 20.0)  # not the mean of the three rates
    assert agg["acceptance_rate"] == pytest.approx(180 / 240) and agg["tokens_per_round"] == pytest.approx(2.5)
    assert agg["ttft_s"] == pytest.approx(4.0 / 3, abs=1e-4)
    assert (agg["compared"], agg["identical"]) == (3, 2)
    assert agg["prefix_reused_tokens"] == 250 and agg["prompt_tokens"] == 600


def test_summary_ratios_ttft_growth_and_targets():
    rows = synthetic_rows()
    mark_reference(rows)
    summary = summarize(rows, ["target-only", "hybrid"])
    assert summary["reference"] == "target-only" and summary["classes"] == ["edit", "prose"]
    turn = {(p["class"], p["turn"], p["mode"]): p for p in summary["per_turn"]}
    assert turn[("edit", 1, "hybrid")]["speedup"] == pytest.approx(1.0)
    assert turn[("edit", 2, "hybrid")]["speedup"] == pytest.approx(2.0)
    assert turn[("edit", 1, "hybrid")]["ttft_ratio"] == pytest.approx(2.0)
    assert turn[("prose", 1, "target-only")]["speedup"] == pytest.approx(1.0)

    per_class = {(c["class"], c["mode"]): c for c in summary["per_class"]}
    edit = per_class[("edit", "hybrid")]
    assert edit["all"]["speedup"] == pytest.approx((300 / 20) / 10)
    assert edit["from_turn_2"]["speedup"] == pytest.approx(2.0)
    assert edit["ttft_growth"] == {"ratio": pytest.approx(0.5), "last_turn": 3, "conversations": 1}
    assert per_class[("edit", "target-only")]["ttft_growth"]["ratio"] == pytest.approx(1.1)
    assert per_class[("prose", "hybrid")]["all"]["speedup"] == pytest.approx(9.5 / 10)

    overall = {o["mode"]: o for o in summary["overall"]}
    hybrid = overall["hybrid"]
    assert hybrid["repeating_from_turn_2"]["speedup"] == pytest.approx(2.0)
    assert hybrid["control"]["speedup"] == pytest.approx(0.95)
    assert hybrid["worst_class"] == {"class": "prose", "speedup": pytest.approx(0.95)}
    assert hybrid["worst_ttft_growth"] == {"class": "edit", "ratio": pytest.approx(0.5)}
    assert hybrid["first_difference"] == {"conversation": "e1", "turn": 3}
    assert overall["target-only"]["first_difference"] is None

    met = {(t["mode"], t["check"].split(",")[0].split(" (")[0]): t["met"] for t in summary["targets"]}
    assert met[("hybrid", "repeating classes from turn 2")] is True  # 2.0x >= 1.4x
    assert met[("hybrid", "every class")] is False  # prose at 0.95x < 0.98x
    assert met[("hybrid", "TTFT")] is True and met[("target-only", "TTFT")] is True  # 0.5 and 1.1 <= 1.2
    assert met[("hybrid", "greedy output identical to target-only")] is False  # e1 turn 3
    assert ("target-only", "repeating classes from turn 2") not in met


def test_summary_without_the_reference_has_no_ratios():
    rows = [r for r in synthetic_rows() if r["mode"] == "hybrid"]
    mark_reference(rows)
    summary = summarize(rows, ["hybrid"])
    assert summary["reference"] is None
    assert all(p["speedup"] is None for p in summary["per_turn"])
    assert [t["check"] for t in summary["targets"]] == ["TTFT, last turn / turn 1 (worst repeating class)"]


def test_markdown_renders_every_table_even_for_an_empty_run():
    rows = synthetic_rows()
    mark_reference(rows)
    config = {"target_model": "T", "draft_model": "D", "max_tokens": 8}
    report = {"config": config, "conversations": [{"id": "e1", "class": "edit", "turns": 3}], "rows": rows,
              "summary": summarize(rows, ["target-only", "hybrid"])}
    table = markdown(report)
    for heading in ("### Overall", "### Targets", "### Per class", "### Per turn: tokens/s",
                    "### Per turn: time to first token", "### Per turn: acceptance"):
        assert heading in table
    assert "| hybrid | 20.00 | 2.00x |" in table  # repeating classes from turn 2
    assert "| edit | 2 | 200 | 10.00 (1.00x) | 20.00 (2.00x) |" in table
    assert "| edit | 3 | 300 | 1.10 s (0%) | 1.00 s (50%) |" in table
    assert "| hybrid | every class, vs target-only (worst class) | >= 0.98x | 0.95 | **no** |" in table
    empty = markdown({"config": config, "conversations": [], "rows": [], "error": "boom",
                      "summary": summarize([], ["target-only"])})
    assert "The run stopped early:** boom" in empty and "### Per turn: tokens/s" in empty


# ---------------------------------------------------------------------------------------------- end to end

def test_bench_serve_runs_conversations_through_each_mode_on_the_tiny_models(tmp_path):
    report_path, table_path = tmp_path / "serve.json", tmp_path / "serve.md"
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "bench-serve", "--target-model", "tiny-random-qwen2",
         "--draft-model", "tiny-random-qwen2", "--engine", "transformers", "--dtype", "float64", "--device", "cpu",
         "--threads", "1", "--modes", "target-only,hybrid", "--classes", "prose", "--conversations-per-class", "1",
         "--max-turns", "2", "--max-tokens", "8", "--json", str(report_path), "--markdown", str(table_path)],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-5000:]
    report = json.loads(report_path.read_text())
    assert "error" not in report
    assert report["run"]["argv"][:2] == ["--target-model", "tiny-random-qwen2"]
    assert isinstance(report["run"]["machine"]["cpu_flags"], list) and report["run"]["date"]
    assert set(report["fleet"]) == {"target-only", "hybrid"}
    assert set(report["fleet"]["hybrid"]) == {"verifier", "drafter", "suffix_drafter"}
    assert report["fleet"]["hybrid"]["verifier"]["engine"] == "transformers"
    assert report["fleet"]["target-only"]["verifier"]["address"] != report["fleet"]["hybrid"]["verifier"]["address"]

    rows = report["rows"]
    assert sorted((r["mode"], r["turn"]) for r in rows) == [("hybrid", 1), ("hybrid", 2), ("target-only", 1),
                                                            ("target-only", 2)]
    for r in rows:
        assert r["class"] == "prose" and r["conversation"] == "prose-mixed-1"
        assert 0 < r["completion_tokens"] <= 8 and r["prompt_tokens"] > 0 and r["total_s"] > 0
        assert r["ttft_s"] is not None and 0 < r["ttft_s"] <= r["total_s"] and r["text"]
        assert r["rounds"] >= 1  # from the server's --record file
        # greedy on float64 transformers is exact: the same history and the same reply in every mode
        assert r["same_prompt"] is True and r["same_text"] is True, r
    turn2 = {r["mode"]: r for r in rows if r["turn"] == 2}
    assert turn2["target-only"]["prompt_tokens"] > max(r["prompt_tokens"] for r in rows if r["turn"] == 1)
    assert all(r["prefix_reused_tokens"] > 0 for r in turn2.values())  # turn 1's cells, from the prefix cache
    assert turn2["hybrid"]["drafted_tokens"] is not None

    summary = report["summary"]
    assert summary["reference"] == "target-only" and summary["modes"] == ["target-only", "hybrid"]
    hybrid = next(o for o in summary["overall"] if o["mode"] == "hybrid")
    assert hybrid["all"]["identical"] == hybrid["all"]["compared"] == 2 and hybrid["first_difference"] is None
    assert hybrid["control"]["speedup"] is not None and hybrid["repeating"] is None
    table = table_path.read_text()
    assert table in done.stdout and "### Per turn: time to first token" in table and "| prose | 2 |" in table

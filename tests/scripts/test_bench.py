"""The benchmark commands run end to end (tiny models, a few tokens): every mode produces a row, the reports are
written, and speculative modes reproduce target-only greedy output. Speed is not asserted: benchmarks measure it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2", "--dtype", "float32"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True, text=True, timeout=600)


def test_coordinator_bench_runs_every_mode_and_writes_reports(tmp_path):
    # llama-target: asked for, but tiny-random-* models are not GGUF: skipped with a note, not an error.
    modes = "target-only,adaptive,adaptive-cost,pipelined,3,ngram,hf-assisted,hf-target,llama-target"
    done = run("bench", *TINY, "--engine", "transformers", "--modes", modes, "--classes", "code",
               "--limit-prompts", "1", "--max-new-tokens", "12", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "skipping llama-target" in done.stderr and "not a GGUF model" in done.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    assert {row["mode"] for row in report["rows"]} == {"target-only", "adaptive", "adaptive-cost", "pipelined", "k=3",
                                                       "ngram", "hf-assisted", "hf-target"}
    assert "llama-target" in report["skipped_modes"] and "llama-target" not in report["config"]["modes"]
    assert report["config"]["engines"] == {"target": "transformers", "draft": "transformers"}
    assert report["config"]["resolved_engines"] == {"target": "transformers", "draft": "transformers"}
    assert report["info"]["verifier_engine"] == report["info"]["drafter_engine"] == "transformers"
    assert isinstance(report["info"]["cpu"]["cpu_flags"], list)
    speculative = [r for r in report["rows"] if r["mode"] in ("adaptive", "adaptive-cost", "pipelined", "k=3")]
    # The draft model is the target itself: every draft is accepted and nothing diverges from target-only (the cost
    # policy may rightly draft nothing: a draft model as large as the target never pays).
    assert all(r["diverges_at"] is None and r["acceptance_rate"] in (1.0, None if r["mode"] == "adaptive-cost" else 1.0)
               for r in speculative)
    table = (tmp_path / "bench.md").read_text()
    assert "| all | adaptive |" in table and "- skipped llama-target:" in table
    assert "- engines: verifier transformers" in table
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


def test_bench_rejects_unknown_modes():
    done = run("bench", "--modes", "fastest")
    assert done.returncode == 2 and "unknown mode" in done.stderr


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("specmesh_bench_script", REPO / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_bench_parses_llamacpp_modes(bench):
    modes = bench.parse_modes("llama-target,llama-lookup,llama-prompt-lookup,hf-target")
    assert [(m.name, m.kind, m.drafter) for m in modes] == [
        ("target-only", "specmesh", None), ("llama-target", "llamacpp", None), ("llama-lookup", "llamacpp", "ngram"),
        ("hf-target", "hf", None)]
    default = [m.name for m in bench.parse_modes(bench.DEFAULT_MODES)]
    assert default.index("llama-target") == default.index("hf-target") + 1
    assert default.index("llama-lookup") == default.index("llama-target") + 1


def test_bench_skips_llamacpp_modes_for_non_gguf_targets(bench):
    modes = bench.parse_modes("target-only,4,hf-target,llama-target,llama-lookup")
    kept, skipped = bench.drop_unrunnable(modes, "tiny-random-qwen2")
    assert [m.name for m in kept] == ["target-only", "k=4", "hf-target"]
    assert set(skipped) == {"llama-target", "llama-lookup"}
    assert all("not a GGUF model" in reason for reason in skipped.values())
    # Without llama modes nothing is dropped, whatever the target.
    assert bench.drop_unrunnable(modes[:3], "tiny-random-qwen2") == (modes[:3], {})


def test_bench_engine_flags_override_per_side(bench):
    args = bench.build_parser().parse_args(["--engine", "transformers", "--draft-engine", "llamacpp",
                                            "--target-model", "tiny-random-qwen2"])
    assert bench.requested_engines(args) == {"target": "transformers", "draft": "llamacpp"}
    assert bench.resolved_engines(args)["target"] == "transformers"
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--engine", "onnx"])


def test_bench_relative_columns_include_llamacpp_target(bench):
    rows = [{"prompt_id": "p", "mode": m, "tokens_per_s": t, "token_ids": ids}
            for m, t, ids in [("target-only", 10.0, [1, 2, 3]), ("llama-target", 20.0, [1, 2, 3]),
                              ("llama-lookup", 40.0, [1, 2, 4])]]
    bench.add_relative(rows)
    lookup = rows[2]
    assert lookup["speedup"] == 4.0 and lookup["speedup_vs_llama_target"] == 2.0 and lookup["diverges_at"] == 2
    assert rows[1]["diverges_at"] is None

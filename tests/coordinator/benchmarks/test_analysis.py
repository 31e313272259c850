"""From benchmark rows to figures: speedups against every baseline and the first divergence from target-only."""

from __future__ import annotations

from coordinator.benchmarks.analysis import add_relative


def test_bench_relative_columns_include_llamacpp_target():
    rows = [{"prompt_id": "p", "mode": m, "tokens_per_s": t, "token_ids": ids}
            for m, t, ids in [("target-only", 10.0, [1, 2, 3]), ("llama-target", 20.0, [1, 2, 3]),
                              ("llama-lookup", 40.0, [1, 2, 4])]]
    add_relative(rows)
    lookup = rows[2]
    assert lookup["speedup"] == 4.0 and lookup["speedup_vs_llama_target"] == 2.0 and lookup["diverges_at"] == 2
    assert rows[1]["diverges_at"] is None

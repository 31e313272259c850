"""From benchmark rows to figures: speedups against every baseline and the first divergence from target-only."""

from __future__ import annotations

from specmesh_bench.analysis import add_relative


def test_bench_relative_columns_include_llamacpp_target():
    rows = [{"prompt_id": "p", "mode": m, "tokens_per_s": t, "token_ids": ids}
            for m, t, ids in [("target-only", 10.0, [1, 2, 3]), ("llama-target", 20.0, [1, 2, 3]),
                              ("llama-lookup", 40.0, [1, 2, 4])]]
    add_relative(rows)
    lookup = rows[2]
    assert lookup["speedup"] == 4.0 and lookup["speedup_vs_llama_target"] == 2.0 and lookup["diverges_at"] == 2
    assert rows[1]["diverges_at"] is None


def test_the_decode_rate_leaves_the_first_token_out():
    """A side with a slower prefill but the same steps shows it in the first-token time, not in the decode rate."""
    from specmesh_bench.analysis import decode_rate
    from specmesh_bench.reports import per_step_table
    specmesh = {"prompt_id": "p", "mode": "target-only", "tokens_per_s": 101 / 12.0, "token_ids": [1],
                "new_tokens": 101, "elapsed_s": 12.0, "first_token_s": 2.0, "first_tokens": 1}
    engine = {"prompt_id": "p", "mode": "ik-target", "tokens_per_s": 101 / 11.0, "token_ids": [1],
              "new_tokens": 101, "elapsed_s": 11.0, "first_token_s": 1.0, "first_tokens": 1}
    assert decode_rate(specmesh) == decode_rate(engine) == 10.0
    assert decode_rate({"new_tokens": 5, "elapsed_s": 1.0}) is None, "no first-token time: no decode rate"
    rows = [specmesh, engine]
    add_relative(rows)
    assert specmesh["speedup_vs_ik_target"] == round(11 / 12, 4) and specmesh["decode_speedup_vs_ik_target"] == 1.0
    table = per_step_table([{"class": "all", "mode": "target-only", "first_token_ms": 2000.0,
                             "decode_speedup_vs_ik_target": 1.0}], [("speedup_vs_ik_target", "vs ik loop")])
    assert table[-1] == "| all | target-only | 2000 | 1.00x | "

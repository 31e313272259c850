"""From benchmark rows to figures: per-prompt speedups and divergence from target-only, per-class summaries and the
analytic speedup E / (k*c + v(k)) next to the measured one."""

from __future__ import annotations

import statistics

from specmesh_bench.modes import BASELINE, ENGINE_BASELINES, HF_BASELINE, Mode
from coordinator.drafting.costs import expected_tokens_per_round


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def add_relative(rows: list[dict]) -> None:
    """Per-row speedups (tokens/s ratios on the same prompt) and divergence from specmesh target-only (of this run:
    on the llama.cpp engine, whose batched evaluation is not bit-identical to its one-token evaluation, that is the
    exactness report of every speculative mode)."""
    by_prompt: dict[tuple[str, str], dict] = {(r["prompt_id"], r["mode"]): r for r in rows}
    for r in rows:
        base = by_prompt.get((r["prompt_id"], BASELINE))
        hf = by_prompt.get((r["prompt_id"], HF_BASELINE))
        r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 4) if base else None
        r["speedup_vs_hf_target"] = round(r["tokens_per_s"] / hf["tokens_per_s"], 4) if hf else None
        for mode, key, _title in ENGINE_BASELINES:
            engine = by_prompt.get((r["prompt_id"], mode))
            r[key] = round(r["tokens_per_s"] / engine["tokens_per_s"], 4) if engine else None
            rate, engine_rate = decode_rate(r), decode_rate(engine) if engine else None
            r[f"decode_{key}"] = round(rate / engine_rate, 4) if rate and engine_rate else None
        r["diverges_at"] = first_divergence(base["token_ids"], r["token_ids"]) if base else None


def decode_rate(row: dict) -> float | None:
    """Tokens per second after the first token (or the first round's tokens): the per-step rate, without the
    prefill; None where the side does not time its first token."""
    first_s, first_tokens = row.get("first_token_s"), row.get("first_tokens")
    if first_s is None or first_tokens is None or row["new_tokens"] <= first_tokens:
        return None
    return (row["new_tokens"] - first_tokens) / max(row["elapsed_s"] - first_s, 1e-9)


def summarize(rows: list[dict], modes: list[Mode], classes: list[str]) -> list[dict]:
    out = []
    for cls in [*classes, "all"]:
        base_sel = [r for r in rows if r["mode"] == BASELINE and (cls == "all" or r["class"] == cls)]
        base_rounds = sum(r["steady"]["rounds"] for r in base_sel)
        # One target-only round (verify call, steady state): the unit of every cost below.
        t_round = sum(r["steady"]["verify_s"] for r in base_sel) / base_rounds if base_rounds else None
        for mode in modes:
            sel = [r for r in rows if r["mode"] == mode.name and (cls == "all" or r["class"] == cls)]
            if not sel:
                continue
            tokens = sum(r["new_tokens"] for r in sel)
            seconds = sum(r["elapsed_s"] for r in sel)
            rounds = sum(r["rounds"] for r in sel)
            drafted = sum(r["drafted_tokens"] or 0 for r in sel)
            accepted = sum(r["accepted_tokens"] or 0 for r in sel)
            speedups = [r["speedup"] for r in sel if r["speedup"]]
            vs_hf = [r["speedup_vs_hf_target"] for r in sel if r["speedup_vs_hf_target"]]
            vs_engine = {key: [r[key] for r in sel if r.get(key)] for _mode, key, _title in ENGINE_BASELINES}
            decode_vs = {f"decode_{key}": [r[f"decode_{key}"] for r in sel if r.get(f"decode_{key}")]
                         for _mode, key, _title in ENGINE_BASELINES}
            div = [r["diverges_at"] for r in sel if r["diverges_at"] is not None]
            s = {
                "class": cls, "mode": mode.name, "kind": mode.kind, "prompts": len(sel), "new_tokens": tokens,
                "tokens_per_s": round(tokens / seconds, 3) if seconds else None,
                "speedup": round(statistics.geometric_mean(speedups), 4) if speedups else None,
                "speedup_vs_hf_target": round(statistics.geometric_mean(vs_hf), 4) if vs_hf else None,
                **{key: round(statistics.geometric_mean(v), 4) if v else None for key, v in vs_engine.items()},
                **{key: round(statistics.geometric_mean(v), 4) if v else None for key, v in decode_vs.items()},
                "first_token_ms": (round(1000 * statistics.mean(r["first_token_s"] for r in sel), 1)
                                   if all(r.get("first_token_s") is not None for r in sel) else None),
                "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                "mean_accepted_length": round(tokens / rounds, 4) if rounds else None,
                "rounds": rounds,
                "diverged_prompts": len(div), "earliest_divergence": min(div) if div else None,
            }
            if mode.kind == "specmesh":
                s["draft_ms_per_round"] = round(1000 * sum(r["draft_s"] for r in sel) / rounds, 2)
                s["verify_ms_per_round"] = round(1000 * sum(r["verify_s"] for r in sel) / rounds, 2)
                s["rest_ms_per_round"] = round(1000 * sum(r["rest_s"] for r in sel) / rounds, 2)
                s["prefill_round_ms"] = round(1000 * statistics.mean(
                    r["first_round"]["draft_s"] + r["first_round"]["verify_s"] for r in sel if r["first_round"]), 2)
                s.update(analytic_bound(sel, t_round, s["acceptance_rate"]))
            out.append(s)
    return out


def analytic_bound(sel: list[dict], t_round: float | None, a: float | None) -> dict:
    steady_rounds = sum(r["steady"]["rounds"] for r in sel)
    steady_drafted = sum(r["steady"]["drafted"] for r in sel)
    if not t_round or not steady_rounds:
        return {}
    v = sum(r["steady"]["verify_s"] for r in sel) / steady_rounds / t_round
    result = {"target_round_ms": round(1000 * t_round, 2), "v_k": round(v, 4)}
    if not steady_drafted or a is None:  # target-only: v(0) ~ 1 by definition
        return result
    k = steady_drafted / steady_rounds
    c = sum(r["steady"]["draft_s"] for r in sel) / steady_drafted / t_round
    e = expected_tokens_per_round(a, k)
    measured_e = sum(r["new_tokens"] for r in sel) / sum(r["rounds"] for r in sel)
    result.update({"k_mean": round(k, 3), "c": round(c, 4), "expected_tokens_per_round": round(e, 4),
                   "bound_speedup": round(e / (k * c + v), 4),
                   # The same cost model with the measured tokens per round: checks the costs apart from a.
                   "cost_model_speedup": round(measured_e / (k * c + v), 4)})
    return result

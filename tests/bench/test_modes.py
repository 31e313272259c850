"""Benchmark modes: parsing, the default list's order, and which modes a target can run."""

from __future__ import annotations

from specmesh_bench.modes import DEFAULT_MODES, drop_unrunnable, parse_mode, parse_modes


def test_bench_parses_llamacpp_modes():
    modes = parse_modes("llama-target,llama-lookup,llama-prompt-lookup,hf-target,ik-target,ik")
    assert [(m.name, m.kind, m.drafter) for m in modes] == [
        ("target-only", "specmesh", None), ("llama-target", "llamacpp", None), ("llama-lookup", "llamacpp", "ngram"),
        ("hf-target", "hf", None), ("ik-target", "ik", None)]
    default = [m.name for m in parse_modes(DEFAULT_MODES)]
    assert default.index("ik-target") == default.index("hf-target") + 1
    assert default.index("llama-target") == default.index("ik-target") + 1
    assert default.index("llama-lookup") == default.index("llama-target") + 1


def test_bench_skips_llamacpp_modes_for_non_gguf_targets():
    modes = parse_modes("target-only,4,hf-target,llama-target,llama-lookup,ik-target")
    kept, skipped = drop_unrunnable(modes, "tiny-random-qwen2")
    assert [m.name for m in kept] == ["target-only", "k=4", "hf-target"]
    assert set(skipped) == {"llama-target", "llama-lookup", "ik-target"}
    assert all("not a GGUF model" in reason for reason in skipped.values())
    # Without llama modes nothing is dropped, whatever the target.
    assert drop_unrunnable(modes[:3], "tiny-random-qwen2") == (modes[:3], {})


def test_the_hybrid_without_guesses_runs_on_a_coordinator_and_suffix_drafter_of_its_own():
    """Two hybrid modes on one suffix drafter would not be side by side: its trees learn each generation's answer, so
    the second mode on a prompt would draft the first one's output (99% acceptance)."""
    hybrid, without = parse_mode("hybrid"), parse_mode("hybrid-no-guesses")
    assert hybrid.stream_guesses and not without.stream_guesses
    assert (hybrid.drafter, without.drafter) == ("hybrid", "hybrid")
    assert hybrid.coordinator == "hybrid" and without.coordinator == "hybrid-no-guesses"
    assert parse_mode("adaptive-cost").coordinator == "model" and parse_mode("target-only").coordinator is None

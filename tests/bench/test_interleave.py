"""The benchmark's sides take turns prompt by prompt, and run one after the other where their models do not fit in
memory together (or the baselines are pinned to other CPUs)."""

from __future__ import annotations

import argparse

from specmesh_bench.interleave import DEQUANTIZED_GROWTH, HEADROOM_BYTES, baseline_bytes, cannot_interleave
from specmesh_bench.measure import Runner, take_turns
from specmesh_bench.modes import parse_modes

GIB = 1 << 30


def recording_runner(kind: str, calls: list) -> Runner:
    def run(prompt: dict, mode) -> dict:
        calls.append((prompt["id"], mode.name))
        return {"prompt_id": prompt["id"], "mode": mode.name, "kind": kind, "elapsed_s": 1.0}
    return Runner({}, run)


def test_each_prompt_runs_every_mode_starting_one_later():
    calls: list = []
    modes = parse_modes("target-only,adaptive,hf-target,hf-assisted")
    runners = {"specmesh": recording_runner("specmesh", calls), "hf": recording_runner("hf", calls)}
    prompts = [{"id": f"p{i}"} for i in range(5)]
    rows = take_turns(runners, modes, prompts, repeats=1, log=lambda row: None)
    names = [m.name for m in modes]
    assert [row["mode"] for row in rows] == [name for _, name in calls]
    for i, prompt in enumerate(prompts):
        turn = [name for pid, name in calls if pid == prompt["id"]]
        assert turn == names[i % 4:] + names[:i % 4]  # p4 starts over at target-only
    # modes of a side without a runner are not run; without rotation the list order is kept
    calls.clear()
    take_turns({"hf": runners["hf"]}, modes, prompts[:2], repeats=2, log=lambda row: None, rotate=False)
    assert calls == [("p0", "hf-target")] * 2 + [("p0", "hf-assisted")] * 2 + [("p1", "hf-target")] * 2 + \
        [("p1", "hf-assisted")] * 2


def args(**overrides) -> argparse.Namespace:
    return argparse.Namespace(**{"baseline_cpus": None, "target_model": "tiny-random-qwen2", **overrides})


TRANSFORMERS_WORKERS = {"verifier": {"bytes": 6 * GIB, "engine": "transformers"},
                        "drafter": {"bytes": 2 * GIB, "engine": "transformers"}}


def test_the_baselines_need_the_workers_models_again():
    modes = parse_modes("target-only,adaptive,hf-target,hf-assisted")
    assert baseline_bytes(args(), modes, TRANSFORMERS_WORKERS) == 8 * GIB
    assert baseline_bytes(args(), parse_modes("target-only,hf-target"), TRANSFORMERS_WORKERS) == 6 * GIB
    assert baseline_bytes(args(), parse_modes("target-only,adaptive"), TRANSFORMERS_WORKERS) == 0
    # llama.cpp workers hold quantized weights: HF dequantizes them
    quantized = {"verifier": {"bytes": GIB, "engine": "llamacpp"}}
    assert baseline_bytes(args(), modes, quantized) == 2 * DEQUANTIZED_GROWTH * GIB  # no drafter: target-sized


def test_interleaving_falls_back_to_phased_when_memory_is_short():
    modes = parse_modes("target-only,adaptive,hf-target,hf-assisted")
    info = {"worker_weights": TRANSFORMERS_WORKERS}
    assert cannot_interleave(args(), modes, info, available=8 * GIB + HEADROOM_BYTES) is None
    why = cannot_interleave(args(), modes, info, available=8 * GIB)
    assert why and "8.0 GiB" in why
    assert cannot_interleave(args(), parse_modes("target-only,adaptive"), info, available=0) is None  # no baselines
    assert "--baseline-cpus" in cannot_interleave(args(baseline_cpus="0"), modes, info, available=64 * GIB)

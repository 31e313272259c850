"""The real default pair (Qwen2.5-Coder 0.5B drafting for 1.5B), drafter and verifier as subprocesses, driven through
the `coordinator generate` CLI in float32, where speculative output must equal target-only output token for token.
(In bf16 a k-token verify pass and one-token steps give slightly different logits and near-ties can flip; that
divergence is measured by scripts, not asserted here.)"""

from __future__ import annotations

import json
import subprocess
import sys

from concurrent.futures import ThreadPoolExecutor

import pytest

from coordinator import Coordinator, GenerationOptions
from specmesh.ops.metrics import read_histogram

pytestmark = pytest.mark.real_models

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a bash one-liner that counts the lines of every .py file in a directory.",
    "Explain in one sentence what a hash map is.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def metrics_port(real_pair):
    return real_pair.metrics_port


@pytest.fixture(scope="module")
def workers(real_pair):
    """The first verifier of the session's real pair (tests/conftest.py), with its metrics, and the drafter."""
    verifier = real_pair.workers[0]
    drafter = next(w for w in real_pair.workers if w.spec.role == "drafter")
    return {"verifier": verifier.address, "drafter": drafter.address}


def batch_histogram(metrics_port: int) -> tuple[float, float]:
    return read_histogram(f"http://127.0.0.1:{metrics_port}/metrics", "specmesh_verify_batch_size")


BASELINES: dict[str, dict] = {}


def target_only(workers, prompt: str) -> dict:
    """`--draft-tokens 0` output for `prompt`, computed once per module."""
    if prompt not in BASELINES:
        BASELINES[prompt] = generate(workers, prompt, "--draft-tokens", "0")
    return BASELINES[prompt]


def generate(workers, prompt: str, *args: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "coordinator", "generate", "--prompt", prompt, "--json",
                          "--verifier", workers["verifier"], "--drafter", workers["drafter"],
                          "--max-new-tokens", str(MAX_NEW), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_equals_target_only_greedy(workers, prompt):
    baseline = target_only(workers, prompt)
    # Adaptive k by the heuristic, which always drafts (the default cost policy decides from measured costs whether
    # drafting pays on this machine, and may rightly not draft: its own test is below).
    speculative = generate(workers, prompt, "--draft-policy", "heuristic")
    assert speculative["token_ids"] == baseline["token_ids"]
    assert speculative["text"] == baseline["text"]
    assert len(baseline["token_ids"]) > 0
    # The 0.5B draft agrees with the 1.5B target most of the time: speculation must actually happen.
    assert speculative["stats"]["acceptance_rate"] > 0.3
    assert speculative["stats"]["rounds"] < baseline["stats"]["rounds"]


def test_fixed_k_equals_target_only_greedy(workers):
    baseline = target_only(workers, PROMPTS[0])
    assert generate(workers, PROMPTS[0], "--draft-tokens", "5")["token_ids"] == baseline["token_ids"]


def test_cost_draft_policy_equals_target_only_greedy(workers):
    for prompt in PROMPTS[:2]:
        cost = generate(workers, prompt, "--draft-policy", "cost")
        assert cost["token_ids"] == target_only(workers, prompt)["token_ids"]


def concurrently(workers, draft_tokens: int | None) -> list[list[int]]:
    """Token ids of all PROMPTS generated at once, through one verifier."""
    with Coordinator(verifier=workers["verifier"], drafter=workers["drafter"]) as coordinator, \
            ThreadPoolExecutor(len(PROMPTS)) as pool:
        options = GenerationOptions(max_new_tokens=MAX_NEW, draft_tokens=draft_tokens)
        return [r.token_ids for r in pool.map(lambda p: coordinator.generate(p, options), PROMPTS)]


def test_concurrent_generations_share_forward_passes_and_stay_exact(workers, metrics_port):
    """Three target-only generations at once: their Verify calls run in shared forward passes (the verifier's
    batch-size histogram says so), and each output still equals its own target-only decoding."""
    before = batch_histogram(metrics_port)
    outputs = concurrently(workers, draft_tokens=0)
    after = batch_histogram(metrics_port)
    assert outputs == [target_only(workers, p)["token_ids"] for p in PROMPTS]
    sessions, passes = after[0] - before[0], after[1] - before[1]
    assert sessions / passes > 1.5, f"{sessions} verifications in {passes} forward passes: little batching"


def test_concurrent_speculative_generations_stay_exact(workers):
    assert concurrently(workers, draft_tokens=None) == [target_only(workers, p)["token_ids"] for p in PROMPTS]

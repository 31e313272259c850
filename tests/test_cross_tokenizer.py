"""Drafting across tokenizers end to end: real gRPC servers with tiny random models in float64, a drafter
(tiny-random-llama) whose tokenizer is not the target's (tiny-random-qwen2). The output is the target's own."""

from __future__ import annotations

import pytest

from coordinator import Coordinator, GenerationOptions
from coordinator.api import TokenizerMismatch
from drafter.service import run_server as run_drafter
from tests.helpers import reference_greedy
from verifier.service import run_server as run_verifier

PROMPT_TEXT = "def fibonacci(n):\n    "
MAX_NEW = 32


@pytest.fixture(scope="module")
def verifier(tiny_target):
    with run_verifier(tiny_target, port=0) as server:
        yield server


@pytest.fixture(scope="module")
def other_drafter(tiny_other_tokenizer):
    with run_drafter(tiny_other_tokenizer, port=0) as server:
        yield server


@pytest.fixture(scope="module")
def prompt(tiny_target):
    return tiny_target.tokenizer(PROMPT_TEXT)["input_ids"]


@pytest.fixture(scope="module")
def expected(tiny_target, prompt):
    return reference_greedy(tiny_target.model, prompt, MAX_NEW, set(tiny_target.eos_token_ids))


def generate(verifier, drafter, tokenizer, prompt, **options):
    with Coordinator(verifier=verifier.address, drafter=drafter.address, tokenizer=tokenizer) as c:
        return c.generate(list(prompt), GenerationOptions(max_new_tokens=MAX_NEW, draft_policy="heuristic",
                                                          **options))


@pytest.mark.parametrize("options", [{}, {"draft_tokens": 3}, {"pipeline": True}], ids=["adaptive", "k3", "pipelined"])
def test_greedy_equals_target_only(verifier, other_drafter, tiny_target, prompt, expected, options):
    result = generate(verifier, other_drafter, tiny_target.tokenizer, prompt, **options)
    assert result.token_ids == expected
    assert result.stats["draft_tokenizer"] == "translated"
    assert result.stats["drafted_tokens"] > 0 and result.stats["degraded_rounds"] == 0


def test_same_tokenizer_takes_the_fast_path(verifier, tiny_target, prompt, expected):
    with run_drafter(tiny_target, port=0) as same:
        result = generate(verifier, same, tiny_target.tokenizer, prompt)
    assert result.token_ids == expected
    assert result.stats["draft_tokenizer"] == "shared" and result.stats["acceptance_rate"] == 1.0


def test_seeded_sampling_repeats_and_seeds_differ(verifier, other_drafter, tiny_target, prompt):
    runs = [generate(verifier, other_drafter, tiny_target.tokenizer, prompt, temperature=1.0, top_p=0.95,
                     seed=seed) for seed in (7, 7, 8)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids
    assert runs[0].stats["drafted_tokens"] > 0 and runs[0].stats["degraded_rounds"] == 0


def test_a_drafter_tokenizer_that_cannot_load_is_a_clear_error(verifier, other_drafter, tiny_target, monkeypatch):
    def unavailable(spec, progress=True):
        raise OSError(f"{spec}: not found")
    monkeypatch.setattr("coordinator.api.load_tokenizer", unavailable)
    with pytest.raises(TokenizerMismatch) as error:
        Coordinator(verifier=verifier.address, drafter=other_drafter.address, tokenizer=tiny_target.tokenizer)
    assert "tiny-random-llama" in str(error.value) and "loading it failed" in str(error.value)

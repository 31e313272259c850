"""The coordinator CLI end to end: it starts drafter and verifier subprocesses itself (tiny models, float64)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specmesh.runtime.models import load_model
from tests.helpers import reference_greedy

TINY = ["--target-model", "tiny-random-qwen2", "--draft-model", "tiny-random-qwen2-b", "--dtype", "float64",
        "--device", "cpu", "--no-chat"]


def coordinator(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def expected():
    target = load_model("tiny-random-qwen2", device="cpu", dtype="float64")
    prompt = target.tokenizer("hello world")["input_ids"]
    return reference_greedy(target.model, prompt, 24, set(target.eos_token_ids))


def test_generate_starts_local_workers_and_matches_target(expected):
    run = coordinator("generate", "--prompt", "hello world", "--max-new-tokens", "24", "--json",
                      "--draft-policy", "heuristic", *TINY)  # the heuristic always drafts
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["status"] == "ok"
    assert out["token_ids"] == expected
    assert out["stats"]["rounds"] < 24 or out["stats"]["acceptance_rate"] is not None
    # By default a local suffix drafter runs beside the model drafter: drafting is hybrid, and the stats say which
    # source drafted how many rounds.
    assert out["stats"]["suffix_drafter"] is True
    assert out["stats"]["suffix_rounds"] + out["stats"]["model_rounds"] > 0
    assert out["stats"]["model_openings_declined"] >= 0


def test_no_suffix_drafts_with_the_model_drafter_alone(expected):
    run = coordinator("generate", "--prompt", "hello world", "--max-new-tokens", "24", "--json", "--no-suffix",
                      "--draft-policy", "heuristic", *TINY)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["token_ids"] == expected
    assert "suffix_drafter" not in out["stats"] and "suffix_rounds" not in out["stats"]


def test_original_short_flags_are_aliases_and_prefixes_are_not_accepted(expected):
    """The script specmesh grew from was run as `--prompt ... --max 100 --draft 4`: both are documented aliases.
    Abbreviations are off, so a new flag can never make an old command line ambiguous."""
    run = coordinator("generate", "--prompt", "hello world", "--max", "24", "--draft", "4", "--json", *TINY)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["token_ids"] == expected
    abbreviated = coordinator("generate", "--prompt", "hello world", "--max-new", "24", *TINY)
    assert abbreviated.returncode == 2 and "unrecognized arguments: --max-new" in abbreviated.stderr


def test_generate_streams_text_and_prints_summary(expected):
    run = coordinator("generate", "--prompt", "hello world", "--max-new-tokens", "24", "--draft-tokens", "3", *TINY)
    assert run.returncode == 0, run.stderr
    assert "tokens/s" in run.stderr and "acceptance rate" in run.stderr and "rounds" in run.stderr
    assert "drafted by the suffix drafter in" in run.stderr
    assert run.stdout  # the generated text, streamed


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "-3"], "max_new_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--draft-tokens", "-1"], "draft_tokens"),
])
def test_bad_arguments_get_a_clear_message(args, message):
    run = coordinator("generate", "--prompt", "x", *args, *TINY)
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr


def test_unknown_model_fails_cleanly():
    """Before any worker starts: one line, status 2 (tests/coordinator/test_cli_errors.py has every such error)."""
    run = coordinator("generate", "--prompt", "x", "--max-new-tokens", "4", "--target-model", "tiny-random-nope",
                      "--draft-tokens", "0", "--device", "cpu")
    assert run.returncode == 2
    assert run.stderr.startswith("coordinator: error: --target-model 'tiny-random-nope' is no tiny preset")
    assert len(run.stderr.splitlines()) == 1


def test_models_list_names_the_catalog():
    run = coordinator("models", "list")
    assert run.returncode == 0
    for name in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"):
        assert name in run.stdout


def test_models_pull_unknown_name():
    run = coordinator("models", "pull", "no-such-model")
    assert run.returncode == 2 and "unknown model" in run.stderr


def test_the_coordinator_imports_no_server_code():
    """A client depends on the wire contract, the decoding math and a tokenizer: never on the worker server, the
    model engines or llama.cpp (specmesh.worker, the server package, pulls in the engines and the gRPC server)."""
    code = ("import sys, coordinator.api, coordinator.cli, coordinator.serving.http_api; "
            "print(sorted(m for m in sys.modules if m.startswith(('specmesh.worker', "
            "'specmesh.runtime.llamacpp', 'specmesh.runtime.transformers', 'specmesh.runtime.batched_forward', "
            "'llama_cpp', 'verifier', 'drafter'))))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_the_summary_names_the_engines_and_their_builds():
    from coordinator.cli import _engines

    build = "ik-llama-cpp-python 0.1.5 (avx2 build), repack on"
    assert _engines({"verifier_engine": "ik", "drafter_engine": "ik", "verifier_engine_build": build,
                     "drafter_engine_build": build}) == f"ik ({build})"
    assert _engines({"verifier_engine": "ik", "drafter_engine": "transformers", "verifier_engine_build": build}) == (
        f"verifier ik ({build}), drafter transformers")
    assert _engines({"verifier_engine": "transformers"}) == "transformers"


def test_an_engine_builds_vector_extensions_are_read_from_its_system_info():
    from specmesh.runtime.ik_binding import build_features

    info = "AVX = 1 | AVX_VNNI = 0 | AVX2 = 1 | AVX512 = 0 | AVX512_VNNI = 1 | FMA = 1 | NEON = 0 | F16C = 1 |"
    assert build_features(info) == ["avx", "avx2", "avx512_vnni", "fma", "f16c"]
    assert build_features(None) == []

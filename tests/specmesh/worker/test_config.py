"""Worker settings: each config refuses what cannot work when it is built, and run_server's flat options reach the
config that owns them."""

from __future__ import annotations

import pytest

from specmesh.worker.config import FaultInjection, ModelConfig, ServerConfig, split_options
from specmesh.worker.session_store import SessionLimits


@pytest.mark.parametrize("config, message", [
    (lambda: ServerConfig(port=70000), "port"),
    (lambda: ServerConfig(max_draft_tokens=0), "max_draft_tokens"),
    (lambda: ServerConfig(max_message_bytes=10), "max_message_bytes"),
    (lambda: ServerConfig(max_concurrent_rpcs=0), "max_concurrent_rpcs"),
    (lambda: ServerConfig(token="short"), "at least 16"),
    (lambda: ServerConfig(max_context_length=1), "max_context_length"),
    (lambda: ModelConfig("m", engine="onnx"), "engine"),
    (lambda: ModelConfig("m", linear_backend="blas"), "linear_backend"),
    (lambda: ModelConfig("m", threads=0), "threads"),
    (lambda: FaultInjection(inject_latency_s=-1), "inject_latency_s"),
    (lambda: FaultInjection(inject_latency_s=float("nan")), "inject_latency_s"),
])
def test_configs_refuse_bad_values(config, message):
    with pytest.raises(ValueError, match=message):
        config()


def test_defaults_are_valid_and_production_settings_carry_no_test_knobs():
    assert ServerConfig().port == 0 and ModelConfig("m").engine == "auto" and FaultInjection().inject_latency_s == 0
    assert not {"inject_latency_s", "role", "model", "max_batch_size"} & set(ServerConfig.__dataclass_fields__)


def test_split_options_routes_each_option_to_its_config():
    limits = SessionLimits(max_sessions=3)
    server, model, faults = split_options(
        {"port": 5, "limits": limits, "device": "cpu", "threads": 2, "inject_latency_s": 0.5},
        ServerConfig, ModelConfig, FaultInjection)
    assert server == {"port": 5, "limits": limits}
    assert model == {"device": "cpu", "threads": 2}
    assert faults == {"inject_latency_s": 0.5}
    assert split_options({}, ServerConfig, FaultInjection) == [{}, {}]


def test_split_options_refuses_an_option_no_config_has():
    with pytest.raises(TypeError, match="max_batch_size"):
        split_options({"max_batch_size": 4}, ServerConfig, ModelConfig, FaultInjection)


def test_a_worker_frees_the_tokenizer_of_the_model_it_loads_and_keeps_a_preloaded_ones(tiny_target):
    from specmesh.runtime.fingerprint import tokenizer_fingerprint

    own = ModelConfig("tiny-random-qwen2", device="cpu", dtype="float64").load(ServerConfig())
    assert own.tokenizer is None and own.loaded.tokenizer is None  # freed: only the load needed it
    assert own.fingerprint == tokenizer_fingerprint(tiny_target.tokenizer)  # what Info reports stays
    assert own.eos_token_ids == tiny_target.eos_token_ids
    shared = ModelConfig("tiny-random-qwen2").load(ServerConfig(), preloaded=tiny_target)
    assert shared.tokenizer is tiny_target.tokenizer  # a preloaded model may be the caller's too: left alone

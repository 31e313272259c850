"""oneDNN linear layers: same results as torch's kernels (to float32 rounding), far cheaper multi-token
passes (measured by scripts, not asserted here)."""

from __future__ import annotations

import pytest
import torch

from specmesh.runtime import onednn, transformers_engine
from specmesh.runtime.kv_cache import CachedSequence
from specmesh.runtime.models import load_model

pytestmark = pytest.mark.skipif(not onednn.supported(torch.float32), reason="no oneDNN on this torch build")


def test_packed_linear_equals_nn_linear():
    torch.manual_seed(0)
    for bias in (True, False):
        linear = torch.nn.Linear(48, 80, bias=bias)
        packed = onednn.OneDnnLinear(linear)
        for shape in [(1, 48), (7, 48), (2, 5, 48)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
            assert packed(x).shape == (*shape[:-1], 80)
        x = torch.randn(4, 96)[:, ::2]  # a non-contiguous view
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-random-qwen2", "tiny-random-llama"])
def test_packed_model_matches_torch_kernels_with_kv_cache(preset):
    plain = load_model(preset, device="cpu", dtype="float32", linear_backend="torch", progress=False)
    packed = load_model(preset, device="cpu", dtype="float32", linear_backend="auto", progress=False)
    assert plain.linear_backend == "torch" and packed.linear_backend == "onednn"
    assert not any(type(m) is torch.nn.Linear for m in packed.model.modules())
    assert packed.vocab_size == plain.vocab_size
    tokens = list(range(3, 40))
    a, b = CachedSequence(plain.model), CachedSequence(packed.model)
    for end in (20, 25, 31, 40):  # growing sequence: prefill then multi-token steps through the KV cache
        torch.testing.assert_close(b.logits_for(tokens[:end], 5), a.logits_for(tokens[:end], 5), rtol=1e-4,
                                   atol=1e-4)


def test_tied_output_layer_keeps_one_copy_of_the_embedding():
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 16)
    output = torch.nn.Linear(16, 50, bias=False)
    output.weight = embedding.weight  # tied, as Qwen2.5 ties lm_head to embed_tokens
    model = torch.nn.ModuleDict({"embed": embedding, "head": output})
    x = torch.randn(3, 16)
    expected = output(x)
    onednn.pack_linears(model)
    assert model["head"].weight is model["embed"].weight
    assert transformers_engine.weights_bytes(model) == 50 * 16 * 4
    torch.testing.assert_close(model["head"](x), expected, rtol=1e-5, atol=1e-5)


def test_backend_choice_is_validated():
    assert not onednn.use_onednn("auto", torch.device("cpu"), torch.float64), "float64 keeps torch's kernels"
    assert not onednn.use_onednn("torch", torch.device("cpu"), torch.float32)
    assert onednn.use_onednn("auto", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="not available"):
        onednn.use_onednn("onednn", torch.device("cpu"), torch.float64)
    with pytest.raises(ValueError, match="linear backend"):
        onednn.use_onednn("fast", torch.device("cpu"), torch.float32)

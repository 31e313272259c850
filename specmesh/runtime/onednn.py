"""CPU linear layers with their weights pre-packed for oneDNN.

Speculative decoding and cross-session batching both rest on one assumption: a forward pass over a few tokens costs
about as much as over one, because reading the weights dominates. torch's default CPU path for nn.Linear breaks that
for 2-7 rows on CPUs without AMX: it costs about one single-row pass per row (measured here, fp32, Qwen2.5 1.5B:
1 token 662 ms, 5 tokens 2,150 ms). oneDNN's linear with the weight converted once to its own layout keeps the
weights-bound behaviour (465 ms and 815 ms), so verifying k drafts or batching sessions becomes cheap. This is what
torch.utils.mkldnn.to_mkldnn does for nn.Linear, extended to the 3D activations of transformers.

Used for float32 (and bfloat16 where the CPU supports oneDNN's bf16 path); other dtypes keep torch's kernels.
"""

from __future__ import annotations

import functools

import torch

BACKENDS = ("auto", "torch", "onednn")


class OneDnnLinear(torch.nn.Module):
    """Inference-only nn.Linear whose weight lives in oneDNN's layout (converted once, at load)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        bias = linear.bias.detach() if linear.bias is not None else torch.zeros(self.out_features, dtype=weight.dtype)
        # Buffers of the mkldnn layout: not parameters, never in a state dict that gets saved.
        self.packed_weight = weight.to_mkldnn()
        self.packed_bias = bias.to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch._C._nn.mkldnn_linear(rows.to_mkldnn(), self.packed_weight, self.packed_bias).to_dense()
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


@functools.cache
def supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs here in `dtype` (bf16 needs avx512bw/vl/dq or avx_ne_convert)."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        OneDnnLinear(torch.nn.Linear(8, 8).to(dtype))(torch.ones(2, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


def use_onednn(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"linear backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch" or device.type != "cpu":
        return False
    if not supported(dtype):
        if backend == "onednn":
            raise ValueError(f"oneDNN linear layers are not available for {dtype} on this CPU")
        return False
    return True


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every nn.Linear in `model` by a OneDnnLinear, in place; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, OneDnnLinear(child))
                replaced += 1
    return replaced

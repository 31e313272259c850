"""CPU linear layers with their weights pre-packed for oneDNN.

Speculative decoding and cross-session batching both rest on one assumption: a forward pass over a few tokens costs
about as much as over one, because reading the weights dominates. torch's default CPU path for nn.Linear breaks that
for 2-7 rows on CPUs without AMX: it costs about one single-row pass per row (measured here, fp32, Qwen2.5 1.5B:
1 token 662 ms, 5 tokens 2,150 ms). oneDNN's linear with the weight converted once to its own layout keeps the
weights-bound behaviour (465 ms and 815 ms), so verifying k drafts or batching sessions becomes cheap.

The weight stays the model's own dense tensor: oneDNN reads it in place (plain layout), so it is held once. An earlier
version converted it with `Tensor.to_mkldnn()` (what torch.utils.mkldnn does), which for float32 is a plain-layout
copy: same kernel, same results bit for bit, same speed (measured: lm_head of Qwen2.5 0.5B, 1 row 22.5 vs 21.6 ms),
but a second copy of every tied embedding (0.51 GiB for the 0.5B drafter, 0.87 GiB for the 1.5B target).

Used for float32 (and bfloat16 where the CPU supports oneDNN's bf16 path); other dtypes keep torch's kernels.
"""

from __future__ import annotations

import functools

import torch

from specmesh.runtime.linear_backends import BACKENDS


class OneDnnLinear(torch.nn.Module):
    """Inference-only nn.Linear computed by oneDNN's inner product on the layer's own weight."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The same Parameter objects, not copies: a weight tied to the input embedding stays tied (one tensor).
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        # The op inductor emits for CPU linears; "none": no fused activation.
        out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
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

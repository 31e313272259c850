"""Weights held once, in the process's own memory: copied out of the checkpoint's mapping (page cache can be
reclaimed, and a worker would then read its weights back from disk on its next call)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specmesh.runtime.mapped_weights import hold_weights_once, mapped_parameters


def mapped_tensor(path, values: torch.Tensor) -> torch.Tensor:
    """`values` written to `path` and read back as a view of the file's memory mapping."""
    values.numpy().tofile(path)
    return torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r+", shape=tuple(values.shape)))


def two_layers(tmp_path, mapped: tuple[bool, bool]) -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    for i, (layer, is_mapped) in enumerate(zip(model, mapped)):
        if is_mapped:
            layer.weight = torch.nn.Parameter(mapped_tensor(tmp_path / f"w{i}.safetensors", layer.weight.detach()),
                                              requires_grad=False)
    return model


@pytest.mark.parametrize("mapped, where, after", [
    ((True, True), "copied", 0),    # the checkpoint holds every weight: copied out, the mapping goes
    ((False, False), "own", 0),     # the loader copied every weight: the mapping has gone already, nothing to do
    ((True, False), "copied", 0),   # some of each: copy all out, so that the mapping (and pages read) can go
])
def test_no_weight_stays_in_a_mapping_of_the_checkpoint(tmp_path, mapped, where, after):
    model = two_layers(tmp_path, mapped)
    x = torch.randn(3, 4)
    expected = model(x)
    assert mapped_parameters(model) == (sum(mapped), 2)
    assert hold_weights_once(model) == where
    assert mapped_parameters(model) == (after, 2)
    assert torch.equal(model(x), expected)


def test_the_default_draft_model_in_float32_holds_its_weights_in_its_own_memory():
    from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL
    from specmesh.runtime.models import load_model

    loaded = load_model(DEFAULT_DRAFT_MODEL, device="cpu", dtype="float32", progress=False)
    mapped, total = mapped_parameters(loaded.model)
    assert mapped == 0 and total > 0

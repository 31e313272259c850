"""Weights held once, in the process's own memory: copied out of the checkpoint's mapping (page cache can be
reclaimed, and a worker would then read its weights back from disk on its next call), except an untied token
embedding, which reads the rows a pass needs from the checkpoint file."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specmesh.runtime.file_embedding import FileBackedEmbedding
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


def test_the_default_draft_model_in_float32_holds_its_matrices_and_reads_embedding_rows_from_its_file():
    from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL
    from specmesh.runtime.models import load_model
    from specmesh.runtime.transformers_engine import weights_bytes

    loaded = load_model(DEFAULT_DRAFT_MODEL, device="cpu", dtype="float32", progress=False)
    mapped, total = mapped_parameters(loaded.model)
    assert mapped == 0 and total > 0
    assert not mapped_files()  # the checkpoint's mapping has gone
    embedding = loaded.model.get_input_embeddings()
    assert isinstance(embedding, FileBackedEmbedding)  # the converted GGUF is untied: its own output layer
    ids = loaded.tokenizer("def add(a, b):\n    return a + b", return_tensors="pt").input_ids
    with safe_open(embedding.path, framework="pt") as checkpoint:
        (name,) = [k for k in checkpoint.keys() if k.endswith("embed_tokens.weight")]
        table = checkpoint.get_tensor(name)
    assert torch.equal(embedding(ids), torch.nn.functional.embedding(ids, table))
    held = [*loaded.model.parameters(), *loaded.model.buffers()]
    assert weights_bytes(loaded.model) == sum(t.numel() * t.element_size() for t in held) + table.numel() * 4


class TinyLM(torch.nn.Module):
    """Embedding and output layer viewing one mapped file, as transformers loads a safetensors checkpoint."""

    def __init__(self, path, vocab: int, width: int, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        torch.randn(2, vocab, width).numpy().tofile(path)
        both = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r+", shape=(2, vocab, width)))
        self.embed = torch.nn.Embedding(vocab, width)
        self.embed.weight = torch.nn.Parameter(both[0], requires_grad=False)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight if tied else torch.nn.Parameter(both[1], requires_grad=False)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def set_input_embeddings(self, embedding: torch.nn.Module) -> None:
        self.embed = embedding

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def mapped_files(suffix: str = ".safetensors") -> set[str]:
    """The files ending in `suffix` this process maps."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        fields = [line.rstrip("\n").split(maxsplit=5) for line in maps]
    return {f[5] for f in fields if len(f) == 6 and f[5].endswith(suffix)}


def test_an_untied_embedding_reads_its_rows_from_the_file_and_the_mapping_goes(tmp_path):
    path = tmp_path / "model.safetensors"
    model = TinyLM(path, vocab=4096, width=64, tied=False)
    ids = torch.tensor([[1, 7, 4000, 7], [0, 4095, 1, 1]])  # repeated ids, the first and the last row
    expected = model(ids)
    assert str(path) in mapped_files()
    assert hold_weights_once(model) == "copied"
    assert isinstance(model.embed, FileBackedEmbedding)
    assert (model.embed.path, model.embed.offset) == (str(path), 0)
    assert mapped_parameters(model) == (0, 1)
    gc.collect()
    assert str(path) not in mapped_files()
    assert torch.equal(model(ids), expected)
    assert model.embed(torch.tensor([], dtype=torch.long)).shape == (0, 64)
    with pytest.raises(IndexError):
        model.embed(torch.tensor([4096]))
    with pytest.raises(IndexError):
        model.embed(torch.tensor([-1]))


def test_a_tied_embedding_is_copied_out_with_the_output_layer(tmp_path):
    model = TinyLM(tmp_path / "model.safetensors", vocab=64, width=16, tied=True)
    ids = torch.tensor([[1, 2, 3]])
    expected = model(ids)
    assert hold_weights_once(model) == "copied"
    assert isinstance(model.embed, torch.nn.Embedding)
    assert mapped_parameters(model) == (0, 1)
    assert model.head.weight is model.embed.weight
    assert torch.equal(model(ids), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_file_backed_embedding_looks_up_what_nn_embedding_does(tmp_path, dtype):
    torch.manual_seed(0)
    table = torch.randn(50, 12).to(dtype)
    path = tmp_path / "table.bin"
    path.write_bytes(b"header" + table.view(torch.uint8).numpy().tobytes())
    embedding = FileBackedEmbedding(str(path), 6, 50, 12, dtype)
    ids = torch.randint(0, 50, (3, 9))
    assert torch.equal(embedding(ids), torch.nn.functional.embedding(ids, table))
    with pytest.raises(ValueError, match="ends before"):
        FileBackedEmbedding(str(path), 7, 50, 12, dtype)

"""The transformers engine: a LoadedModel (any HF causal LM, CPU or GPU) behind the engine seam."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from specmesh.runtime.batched_forward import batched_logits, can_batch
from specmesh.runtime.devices import dtype_name
from specmesh.runtime.file_embedding import file_backed_bytes
from specmesh.runtime.kv_cache import CachedSequence
from specmesh.runtime.models import LoadedModel
from specmesh.runtime.model_thread import ModelThread

T = TypeVar("T")


class _ThreadedSequence(CachedSequence):
    """A CachedSequence whose forward passes run on its engine's model thread."""

    def __init__(self, model: torch.nn.Module, thread: ModelThread) -> None:
        super().__init__(model)
        self._thread = thread

    def logits_for(self, sequence: Sequence[int], last_n: int) -> torch.Tensor:
        return self._thread.run(super().logits_for, sequence, last_n)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers (oneDNN linears use the layers' own weights, see onednn.py), and of a token
    embedding read from the checkpoint file (file_embedding.py)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # tied weights count once
    return sum(t.numel() * t.element_size() for t in tensors.values()) + file_backed_bytes(model)


class TransformersEngine:
    engine = "transformers"

    def __init__(self, loaded: LoadedModel, max_batch_size: int = 64) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.fingerprint = loaded.fingerprint
        self.device = str(loaded.device)
        self.dtype = dtype_name(loaded.dtype)
        self.has_chat_template = loaded.has_chat_template
        self.linear_backend = loaded.linear_backend
        self.context_limit = getattr(loaded.model.config, "max_position_embeddings", None)
        self.max_batch_size = max_batch_size if can_batch(loaded.model) else 1
        self.weights_bytes = weights_bytes(loaded.model)
        self._thread = ModelThread("transformers-forward")

    def new_sequence(self) -> CachedSequence:
        return _ThreadedSequence(self.model, self._thread)

    def release_tokenizer(self) -> None:
        self.tokenizer = None
        self.loaded = dataclasses.replace(self.loaded, tokenizer=None)

    def run_on_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return self._thread.run(fn, *args)

    def batched_logits(self, sequences: Sequence[CachedSequence], requests: Sequence[Sequence[int]],
                       last_ns: Sequence[int]) -> list[torch.Tensor]:
        return self._thread.run(batched_logits, self.model, sequences, requests, last_ns)

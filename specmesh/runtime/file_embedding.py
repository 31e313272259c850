"""A token embedding whose rows are read from the checkpoint file when a pass looks them up, never held in memory.

A pass reads one embedding row per token (3.5 KiB on the 0.5B draft, 6 KiB on the 1.5B target), yet the table is a
large part of a small model: 0.51 GiB of the 0.5B draft's 2.35 GiB of float32 weights, 0.87 of the 1.5B target's
6.62. Held in memory, all of it is resident; left in a memory mapping, each row used maps the pages around it too (the
kernel faults around, about 135 KiB per distinct token measured here), so the resident set grows with every new
token until the table is all there. pread copies just the rows a pass needs out of the page cache: the process holds
none of the table, the kernel keeps the rows in use cached, and a row it dropped costs one small read. The numbers
are the checkpoint's own bytes: lookups are bit-identical to nn.Embedding over the same table (tested)."""

from __future__ import annotations

import os
import weakref

import torch


class FileBackedEmbedding(torch.nn.Module):
    """nn.Embedding's lookup (forward only) over a row-major [num_embeddings, embedding_dim] table stored at `offset`
    in the file at `path`."""

    def __init__(self, path: str, offset: int, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        if offset < 0 or num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"bad table layout: offset {offset}, shape [{num_embeddings}, {embedding_dim}]")
        self.path = path
        self.offset = offset
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.row_bytes = embedding_dim * torch.empty((), dtype=dtype).element_size()
        self.nbytes = num_embeddings * self.row_bytes
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        weakref.finalize(self, os.close, self._fd)
        if os.fstat(self._fd).st_size < offset + self.nbytes:
            raise ValueError(f"{path} ends before the table's {self.nbytes} bytes at offset {offset}")

    @classmethod
    def of_mapped(cls, weight: torch.Tensor, path: str, file_offset: int) -> "FileBackedEmbedding":
        """The embedding reading `weight`'s rows from the file it views: mapped from `path`, at `file_offset`."""
        if weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError("an embedding table must be a contiguous 2-D tensor")
        return cls(path, file_offset, weight.shape[0], weight.shape[1], weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        tokens, where = torch.unique(flat, return_inverse=True)  # a prompt repeats tokens: read each row once
        rows = torch.empty((len(tokens), self.embedding_dim), dtype=self.dtype)
        buffers = rows.view(torch.uint8).numpy()
        for i, token in enumerate(tokens.tolist()):
            if os.preadv(self._fd, [buffers[i]], self.offset + token * self.row_bytes) != self.row_bytes:
                raise OSError(f"short read of row {token} from {self.path}")
        return rows[where].view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}, file={self.path}"


def file_backed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tables `model` reads from files (weights, though not in its memory)."""
    return sum(m.nbytes for m in model.modules() if isinstance(m, FileBackedEmbedding))

"""The llama.cpp engine: a GGUF model run quantized by llama.cpp (llama-cpp-python's low-level API).

One llama context serves every session of the worker. A session is a llama.cpp sequence id; the context's KV cache
is unified (all sequences share its cells), so a long session and many short ones fit the same memory. Each call is
ONE `llama_decode` over the new tokens of every session in it, with logits requested for exactly the positions the
caller needs; rollback removes a sequence's cells past a position (`llama_memory_seq_rm`). When the cells run out,
the least recently used sessions outside the current batch lose their cached keys/values (their histories stay, so
their next call recomputes them). A dropped session's cells stay as a prefix cache entry (its sequence id idle) until
cells or ids run out: a new session sharing its prefix gets those cells by `llama_memory_seq_cp` (shared, not copied)
and decodes only what it adds. The high-level `Llama` class is not used: it keeps a full-vocabulary score array
for the whole context and one sequence only.

llama.cpp's batched evaluation is not bit-identical to its one-token evaluation, so speculative greedy output on this
engine can differ from this engine's own one-token greedy decoding; the divergence is measured (scripts/bench.py),
not hidden.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from specmesh.runtime.gguf_engine import GgufEngine, GgufSequence

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_CELLS = 16384  # KV cells shared by all sessions unless --max-context-length says otherwise
_backend_ready = threading.Lock()
_backend_initialised = False


def _llama():
    """Import llama_cpp once, with its native logging limited to errors (it otherwise prints the model card)."""
    global _backend_initialised
    try:
        import llama_cpp
        from llama_cpp import _logger
    except ImportError as e:
        raise ValueError("the llama.cpp engine needs llama-cpp-python (pip install llama-cpp-python); "
                         "use --engine transformers otherwise") from e
    with _backend_ready:
        if not _backend_initialised:
            _logger.set_verbose(logging.getLogger("llama-cpp-python").isEnabledFor(logging.DEBUG))
            llama_cpp.llama_backend_init()
            _backend_initialised = True
    return llama_cpp


def extra_buffer_types_safe() -> bool:
    """Whether llama.cpp's extra CPU buffer types (AMX tiles, repacked weights) may be used here. On CPUs with AMX,
    llama-cpp-python 0.3.36 built for the machine (GGML_NATIVE) segfaults in the first llama_decode of every model
    tried (measured on a 2-core Sapphire Rapids: smollm2 Q4_1, Qwen2.5 0.5B/1.5B); without them it runs."""
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_int8" not in f.read()
    except OSError:
        return True


@contextmanager
def default_model_params_without_extra_buffers():
    """llama_cpp.Llama builds its model parameters itself: where extra buffer types crash, hand it defaults without."""
    import llama_cpp.llama_cpp as low_level

    if extra_buffer_types_safe():
        yield
        return
    plain = low_level.llama_model_default_params

    def without_extra_buffers():
        params = plain()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = without_extra_buffers
    try:
        yield
    finally:
        low_level.llama_model_default_params = plain



class LlamaSequence(GgufSequence):
    """One session's tokens in the shared llama context (a sequence id), with explicit rollback."""

    def __init__(self, engine: LlamaCppEngine, seq_id: int) -> None:
        super().__init__(engine)
        self.seq_id = seq_id


class LlamaCppEngine(GgufEngine):
    engine = "llamacpp"
    runtime = "llama.cpp"
    deterministic = False  # no such mode: passes round by shape, and sessions share one pool of cells

    def __init__(self, spec: str, path: Path, tokenizer, fingerprint: str, *, device: str = "cpu",
                 threads: int | None = None, max_sessions: int = 64, context_length: int | None = None,
                 max_batch_size: int = 64, prefix_cache: bool = True) -> None:
        self._api = llama_cpp = _llama()
        super().__init__("llamacpp-forward", threads, prefix_cache)
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0 if device == "cpu" else -1
        model_params.use_extra_bufts = extra_buffer_types_safe()
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        n_ctx_train = llama_cpp.llama_model_n_ctx_train(self._model)
        cells = context_length or min(n_ctx_train, DEFAULT_CONTEXT_CELLS)
        self.max_sequences = min(max_sessions + 8, llama_cpp.llama_max_parallel_sequences())
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = cells
        params.n_batch = cells  # one llama_decode may carry a whole prompt; llama.cpp splits it into ubatches
        params.n_seq_max = self.max_sequences
        params.kv_unified = True  # one pool of cells for all sessions, whatever their lengths
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise ValueError(f"llama.cpp could not create a context of {cells} cells for {path}")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(cells, 0, 1)

        self._set_info(spec, path, tokenizer, fingerprint, device, cells, n_ctx_train)
        self.max_batch_size = max_batch_size
        n_layer = llama_cpp.llama_model_n_layer(self._model)
        head_dim = llama_cpp.llama_model_n_embd(self._model) // max(1, llama_cpp.llama_model_n_head(self._model))
        # K and V, f16, every layer, the key/value heads only (GQA).
        self.kv_bytes_per_token = n_layer * 2 * llama_cpp.llama_model_n_head_kv(self._model) * head_dim * 2
        self.weights_bytes = llama_cpp.llama_model_size(self._model)

        self._free_ids = list(range(self.max_sequences - 1, -1, -1))  # ids neither a session nor a cached prefix holds
        self._live: weakref.WeakValueDictionary[int, LlamaSequence] = weakref.WeakValueDictionary()

    def _gguf_eos_ids(self) -> tuple[int, int]:
        return self._api.llama_vocab_eos(self._vocab), self._api.llama_vocab_eot(self._vocab)

    # ------------------------------------------------------------------ sessions

    def new_sequence(self) -> LlamaSequence:
        with self._lock:
            self._take_released()
            if not self._free_ids and not self._drop_least_recent_prefix():
                raise RuntimeError(f"all {self.max_sequences} llama.cpp sequences are in use")
            seq_id = self._free_ids.pop()
            sequence = LlamaSequence(self, seq_id)
            self._live[seq_id] = sequence
            # Its cells become a prefix cache entry (or are removed) before the next decode.
            self._release_when_dropped(sequence, seq_id)
            return sequence

    def _take_released(self) -> None:
        while self._released:
            seq_id, tokens = self._released.pop()
            if self.prefix_cache and tokens:
                self._prefixes.add(seq_id, tokens, seq_id)  # its cells stay: a later session may start from them
            else:
                self._api.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
                self._free_ids.append(seq_id)

    def _drop_least_recent_prefix(self) -> bool:
        """Remove the least recently used prefix cache entry's cells and free its id; False when there is none."""
        dropped = self._prefixes.pop_least_recent()
        if dropped is None:
            return False
        seq_id = dropped[0]
        self._api.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        self._free_ids.append(seq_id)
        return True

    def _resume_from_prefix(self, sequence: LlamaSequence, tokens: list[int], last_n: int) -> None:
        """Start a session that holds no cells from the idle entry sharing the longest prefix with `tokens`: the
        entry's cells get this sequence's id too (llama_memory_seq_cp shares cells, nothing is copied or
        recomputed), so only what the request adds is decoded."""
        if sequence.cached_tokens or not self.prefix_cache:
            return
        key, length = self._prefixes.longest(tokens, last_n)
        if key is None:
            return
        entry = self._prefixes.resumed(key, length)
        self._api.llama_memory_seq_cp(self._memory, entry.handle, sequence.seq_id, 0, length)
        sequence.cached_tokens[:] = entry.tokens[:length]  # in place: the finalizer holds this list

    def remove_cells(self, sequence: LlamaSequence, start: int) -> None:
        with self._lock:
            if not self._api.llama_memory_seq_rm(self._memory, sequence.seq_id, start, -1):
                raise RuntimeError(f"llama.cpp could not remove cells past {start} of sequence {sequence.seq_id}")

    def _evict_for(self, keep: Sequence[LlamaSequence]) -> bool:
        """Free cells: the least recently used prefix cache entry's, else those of the least recently used sequence
        outside `keep`; False when there is neither."""
        if self._drop_least_recent_prefix():
            return True
        kept = {id(s) for s in keep}
        candidates = [s for s in list(self._live.values()) if id(s) not in kept and s.cached_tokens]
        if not candidates:
            return False
        victim = min(candidates, key=lambda s: s.last_used)
        self._api.llama_memory_seq_rm(self._memory, victim.seq_id, -1, -1)
        victim.cached_tokens.clear()  # its history stays with its session: the next call recomputes the keys
        log.info("llama.cpp KV cells full: dropped the cached keys of sequence %d", victim.seq_id)
        return True

    # ------------------------------------------------------------------ forward

    def _forward(self, sequences: list[LlamaSequence], requests: list[list[int]],
                 last_ns: list[int]) -> list[torch.Tensor]:
        """One llama_decode over every session's new tokens."""
        api = self._api
        fresh = []
        for sequence, tokens, last_n in zip(sequences, requests, last_ns):
            self._resume_from_prefix(sequence, tokens, last_n)
            sequence.rollback(sequence.reusable_length(tokens, last_n))
            fresh.append(tokens[len(sequence.cached_tokens):])
        batch = self._batch
        outputs: list[list[int]] = []  # per row, the batch indices whose logits it wants
        n = 0
        for sequence, tokens, last_n in zip(sequences, fresh, last_ns):
            start = len(sequence.cached_tokens)
            for j, token in enumerate(tokens):
                batch.token[n] = token
                batch.pos[n] = start + j
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = sequence.seq_id
                batch.logits[n] = j >= len(tokens) - last_n
                n += 1
            outputs.append(list(range(n - last_n, n)))
        batch.n_tokens = n
        while True:
            status = api.llama_decode(self._ctx, batch)
            if status == 1 and self._evict_for(sequences):
                continue  # no free KV cells: retry after dropping another session's keys
            break
        if status != 0:
            # A failed decode may leave part of the batch in the cache: drop these rows' cells entirely.
            for sequence in sequences:
                sequence.rollback(0)
            raise RuntimeError(f"llama_decode failed with status {status}"
                               + (" (KV cells full: raise --max-context-length)" if status == 1 else ""))
        self._clock += 1
        results = []
        for sequence, tokens, wanted in zip(sequences, fresh, outputs):
            sequence.cached_tokens.extend(tokens)
            sequence.last_used = self._clock
            rows = np.empty((len(wanted), self.vocab_size), dtype=np.float32)
            for r, index in enumerate(wanted):
                rows[r] = np.ctypeslib.as_array(api.llama_get_logits_ith(self._ctx, index), shape=(self.vocab_size,))
            results.append(torch.from_numpy(rows))
        return results

    def _free(self) -> None:
        self._api.llama_batch_free(self._batch)
        self._api.llama_free(self._ctx)
        self._api.llama_model_free(self._model)

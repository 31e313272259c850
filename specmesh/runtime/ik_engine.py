"""The ik_llama.cpp engine: a GGUF model run quantized by ik_llama.cpp (PyPI `ik-llama-cpp-python`, a prebuilt wheel).

Same kernels family as llama.cpp, two properties that matter to speculative decoding on a CPU:
- a k-token pass costs far less than k one-token steps (v(5) about 2.5 steps against 3.6 on llama-cpp-python), so
  drafts can pay;
- with flash attention off, a session's k-token pass is bit-identical to its one-token passes, as long as the session
  is alone in its KV cache with its cells in position order. Measured (tests/specmesh/runtime/test_ik_engine.py and
  docs/engines.md): chunks of 2..16 tokens give max |logit diff| 0.0 against one-token decoding; the same session
  decoded while another session's cells sit in the same cache differs by 0.28 (the attention sums over the cells in
  use, and SIMD lanes group them differently), and in a batch shared with a long session by up to 16.5.

So every session owns a llama context of its own (one model, many contexts: the weights are held once), and a pass
is one `llama_decode` per session: greedy speculative output equals the engine's own one-token greedy decoding token
for token. Contexts are made on first use and capped by a KV budget: past it, the least recently used session outside
the current call gives its context up (its history stays, its next call recomputes it).

Prefix caching: a context a session gave up (it ended, was evicted or expired) keeps its cells and the tokens they
hold. A new session takes the idle context holding the longest prefix of its tokens and computes only the rest, so
turn n of a conversation prefills what turn n added. The kept cells were computed by passes of at most 31 tokens, the
same as a fresh prefill's, so a resumed prefix gives the logits a fresh prefill gives, bit for bit. Idle contexts are
reused least recently used first when no prefix matches.

Sessions are never batched into one `llama_decode` (the llama.cpp engine's layout: one context, a sequence id per
session). On ik_llama.cpp that layout is not merely inexact but wrong: three sessions of 60 tokens in one pass moved a
row's logits by 7.3 (smollm2-135m; 16.5 on the 1.5B default target), where rounding moves them by 0.3; only ubatches
of one token (no batching at all) were exact. Nothing in the context parameters (graph reuse, rope cache, fused ops)
changed that.

Flash attention stays off: with it on, ik_llama.cpp aborts the process on some multi-sequence prefills
(`iqk_fa_templates.h: GGML_ASSERT(S > 0)`) and moves a session's logits when another session shares its batch.

Run-time repack (the default): the weights are repacked at load into ik_llama.cpp's interleaved row layouts, whose
kernels take about half the time of the plain ones on AVX2 and AVX-512 alike. With repack, every pass of 2 to 31
rows gives bit-identical logits whatever its size and alignment (measured on the 1.5B target: passes of 2, 3, 4, 5,
8, 16, 17, 31, mixed sizes, against 2-row passes: max |diff| 0.0; that model held up to a 409-token prompt in one
pass, SmolLM2 Q4_1 did not at 50, so passes stay within 31 as without repack). On the PyPI wheel a one-row pass
differs (0.55-0.67: its kernels have one-row branches of their own). So an exact engine on the wheel never runs a
one-row pass: a one-token step recomputes the previous token's cell with it (2 rows: the cell comes out with the same
bits), a one-token sequence adds a padding row whose cell is removed after, a prefill is split into near-equal passes
of at least 2 rows, and every pass asks for the logits of at least its last 2 rows (the output layer sees the rows
that ask; one row would take the one-row kernel). The row-invariant build that `make setup` compiles (ik_build.py:
the same source with those branches off) gives a one-row pass the bits of the others, so there a one-token step is
one row (27 against 38 ms on the 1.5B target, 2-core Zen 4) and gives the same tokens.
A drafter need not be exact (`exact=False`): it keeps one-row passes, the fastest.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from specmesh.runtime import ik_binding
from specmesh.runtime.gguf_engine import GgufEngine, GgufSequence

log = logging.getLogger(__name__)

DEFAULT_SESSION_CELLS = 4096  # a session's longest history unless --max-context-length says otherwise
DEFAULT_KV_BUDGET_CELLS = 32768  # KV cells of all contexts together: 0.9 GiB on the 1.5B default target
# Contexts of one engine, at most, and of all engines of the process together: ik_llama.cpp segfaults when a process
# holds 32 contexts at once (measured: 31 work; freed ones do not count), a limit of its ggml build.
MAX_CONTEXTS = 16
PROCESS_MAX_CONTEXTS = 30
_process_contexts = 0  # live contexts of every engine in this process
_process_lock = threading.Lock()
# Tokens in one llama_decode, at most. From 32 tokens on, ik_llama.cpp multiplies by the weights on another kernel path:
# its logits differ from one-token decoding by 0.37 on Qwen2.5 Q4_K_M (rounding) and by 19.8 on SmolLM2 Q4_1 (wrong).
# Up to 31 every pass is bit-identical to one-token decoding (measured for 2, 4, 8, 16, 17, 24, 31). So prompts are
# prefilled in passes of 31: 1.6x the time of one pass (256 tokens of the 1.5B: 3.76 s against 2.37 s), and a prefill,
# a resync after failover and a verify all give the logits one-token decoding gives.
MAX_PASS_TOKENS = 31
# With repacked weights no pass of 2 to 31 rows differs from another (see the module docstring), so prompts go in
# passes of up to this many. 31, as without repack: on SmolLM2 Q4_1 a 50-row pass differed from 2-row passes (the
# 1.5B target held to 409 rows; the limit is per kernel, so the lower one stands).
MAX_REPACKED_PASS_TOKENS = 31


SEQ_ID = 0  # a context holds one session, always this sequence id


class IkSequence(GgufSequence):
    """One session's tokens in a llama context of its own, bound on its first pass."""

    def __init__(self, engine: IkLlamaEngine) -> None:
        super().__init__(engine)
        self.context: int | None = None  # the llama context handle; None until a pass needs one, or when evicted


class IkLlamaEngine(GgufEngine):
    engine = "ik"
    runtime = "ik_llama.cpp"
    deterministic = True  # one pass per session, and a k-token pass gives the bits of k one-token passes
    requantize_auto = True  # its repacked Q4_0 kernels step fastest (gguf_engine.py)

    def __init__(self, spec: str, path: Path, tokenizer, fingerprint: str, *, device: str = "cpu",
                 threads: int | None = None, max_sessions: int = 64, context_length: int | None = None,
                 kv_budget_cells: int = DEFAULT_KV_BUDGET_CELLS, repack: bool = True,
                 prefix_cache: bool = True, exact: bool = True) -> None:
        lib = ik_binding.bind()
        self._lib = lib  # the package's api and the calls it lacks (ik_binding.py)
        self._api = api = lib.api
        if device != "cpu" and not lib.supports_gpu_offload():
            raise ValueError("this ik_llama.cpp build has no GPU offload (the PyPI wheel is CPU-only): install the "
                             "binding's CUDA wheel, or use --engine llamacpp built with CUDA, or --device cpu")
        super().__init__("ik-forward", threads, prefix_cache)
        model_params = api.llama_model_default_params()
        model_params.n_gpu_layers = 0 if device == "cpu" else 999
        model_params.repack_tensors = repack  # about 2x faster; exact with two-row steps on the wheel (docstring)
        model_params.use_mmap = False
        self._model = api.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise ValueError(f"ik_llama.cpp could not load {path}")
        self._vocab = api.llama_model_get_vocab(self._model)
        n_ctx_train = lib.n_ctx_train(self._model)
        self.session_cells = context_length or min(n_ctx_train or DEFAULT_SESSION_CELLS, DEFAULT_SESSION_CELLS)
        # As many one-session contexts as the budget holds; at least 2 (a verifier's cost probe and a client), at
        # most MAX_CONTEXTS. More sessions than that take turns (LRU).
        self.max_contexts = min(MAX_CONTEXTS, max(2, kv_budget_cells // self.session_cells), max_sessions + 1)
        self._contexts: list[int] = []  # every context made; those no session holds are prefix cache entries
        self.repack = repack
        self.exact = exact
        # Rows of a pass, at least: with repack the wheel's kernels take other arithmetic for one row than for two or
        # more; the row-invariant build's do not (module docstring).
        self.row_invariant = lib.row_invariant and repack and exact  # checked on this model below
        self.min_pass_rows = 2 if repack and exact else 1
        self.max_pass_tokens = MAX_REPACKED_PASS_TOKENS if repack else MAX_PASS_TOKENS
        self._batch_rows = self.max_pass_tokens + (self.min_pass_rows - 1)  # room for a padding row
        self._batch = api.llama_batch_init(self._batch_rows, 0, 1)

        self._set_info(spec, path, tokenizer, fingerprint, device, self.session_cells, n_ctx_train)
        self.max_batch_size = 1  # one pass per session (see the module docstring): nothing to batch
        self.kv_bytes_per_token = ik_binding.kv_bytes_per_token(lib, self._model)
        self.weights_bytes = lib.model_size(self._model)
        self.build = ik_binding.build_description(repack)

        self._live: weakref.WeakSet[IkSequence] = weakref.WeakSet()
        if self.row_invariant:
            self.min_pass_rows = 1
            if not self._one_row_pass_exact():
                # A weight layout the build's patch does not cover: exact the wheel's way, with two-row steps.
                log.warning("%s: a one-row pass differs from a multi-row one on this build; exact steps take two rows",
                            path.name)
                self.row_invariant, self.min_pass_rows = False, 2
                self.build += ", one-row check failed: two-row steps"

    def _one_row_pass_exact(self) -> bool:
        """Whether this model's one-row pass gives the bits of the same row in a multi-row pass (its output layer
        included). Checked once at load, on the row-invariant build: its patch covers the repacked layouts whose
        one-row kernels round their own way (ik_build.py); a model with another would fall back, not drift."""
        tokens = list(range(100, 108))
        whole = self.new_sequence().logits_for(tokens, 2)[-1:]
        stepped = self.new_sequence()
        stepped.logits_for(tokens[:-1], 1)
        return torch.equal(stepped.logits_for(tokens, 1), whole)

    def _new_context(self) -> int:
        """An empty context, a prefix cache entry until a session takes it."""
        api = self._api
        params = api.llama_context_default_params()
        params.n_ctx = self.session_cells
        params.n_batch = params.n_ubatch = self._batch_rows
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = self.threads
        params.flash_attn = False  # see the module docstring: on, it aborts and is not exact
        global _process_contexts
        with _process_lock:
            handle = api.llama_init_from_model(self._model, params)
            if not handle:
                raise RuntimeError(f"ik_llama.cpp could not create a context of {self.session_cells} cells")
            _process_contexts += 1
        self._contexts.append(handle)
        self._prefixes.add(handle, [], handle)
        return handle

    def _may_add_context(self) -> bool:
        return len(self._contexts) < self.max_contexts and _process_contexts < PROCESS_MAX_CONTEXTS

    def _gguf_eos_ids(self) -> tuple[int, int]:
        return self._lib.vocab_eos(self._vocab), self._lib.token_eot(self._model)

    @property
    def contexts_in_use(self) -> int:
        return len(self._contexts) - len(self._prefixes) - len(self._released)  # released: idle from the next pass on

    # ------------------------------------------------------------------ sessions

    def new_sequence(self) -> IkSequence:
        with self._lock:
            self._take_released()
            sequence = IkSequence(self)
            self._live.add(sequence)
            return sequence

    def _bind(self, sequence: IkSequence, context: int) -> None:
        sequence.context = context
        sequence.cached_tokens = self._prefixes.pop(context).tokens  # the cells' tokens: the session starts from them
        if not self.prefix_cache:
            sequence.rollback(0)
        # A dropped session (ended, evicted, expired) hands its context back with its tokens (a prefix cache entry).
        sequence._finalizer = self._release_when_dropped(sequence, context)

    def _unbind(self, sequence: IkSequence) -> None:
        """Take a session's context away (eviction): its cells stay as a prefix cache entry, its history stays with
        its session (whose next call may well find its own prefix there again)."""
        sequence._finalizer.detach()
        self._prefixes.add(sequence.context, sequence.cached_tokens, sequence.context)
        sequence.context = None
        sequence.cached_tokens = []

    def keep_spare_context(self) -> bool:
        """Make an empty context for the next session that matches no cached prefix, if there is none and the budget
        allows one; True when it made one. Called at the end of a worker's warm-up and then while it serves no request
        (specmesh/worker/idle_upkeep.py): making a context clears its KV cells, and memory touched for the first time
        can be slow to fault in. On a 2-core VM, 4096 cells of the 1.5B target (35,600 page faults) took 0.08 s in a
        fresh process and 0.5-1.8 s once the weights were resident, time a request would wait before its first token.
        Not while a session holds a context: it is between two calls of its generation (a verifier waits while the
        drafter drafts, a drafter while the verifier verifies), and its next call would wait for the new context
        (the real pair, Zen 4: a one-draft verify of 46 ms took 300-430 ms after a draft model round of 150-300 ms)."""
        with self._lock:
            if self._closed or not self.prefix_cache:  # without the prefix cache, any idle context is a spare
                return False
            self._take_released()
            if self.contexts_in_use or self._spare_context() is not None or not self._may_add_context():
                return False
            self._new_context()
            return True

    def _spare_context(self) -> int | None:
        """An idle context that holds no tokens (kept by keep_spare_context), if there is one."""
        return next((entry.handle for entry in self._prefixes if not entry.tokens), None)

    def _take_released(self) -> None:
        while self._released:
            context, tokens = self._released.pop()
            self._prefixes.add(context, tokens, context)

    def remove_cells(self, sequence: IkSequence, start: int) -> None:
        with self._lock:
            if sequence.context is None:  # evicted: its cells went with its context
                return
            if not self._lib.kv_cache_seq_rm(sequence.context, SEQ_ID, start, -1):
                raise RuntimeError(f"ik_llama.cpp could not remove cells past {start}")

    def _context_for(self, sequence: IkSequence, tokens: list[int], last_n: int,
                     call: Sequence[IkSequence]) -> None:
        """Give a session a context of its own: the idle one holding the longest prefix of `tokens`; else an empty
        new one under the budget; else the least recently used idle one; else the least recently used other session's
        (not one of this call's)."""
        if sequence.context is not None:
            return
        best, best_length = self._prefixes.longest(tokens, last_n) if self.prefix_cache else (None, 0)
        if best is None:  # a spare (keep_spare_context): made before this call needed it
            best = self._spare_context()
        # With the prefix cache, a new context keeps the idle ones' prefixes for later; without, an idle one will do.
        if best is None and self._may_add_context() and (self.prefix_cache or not self._prefixes):
            best = self._new_context()
        if best is None and not self._prefixes:
            kept = {id(s) for s in call}
            holders = [s for s in list(self._live) if s.context is not None and id(s) not in kept]
            if not holders:
                raise RuntimeError(f"all {self.max_contexts} ik_llama.cpp contexts are held by this call's sessions")
            victim = min(holders, key=lambda s: s.last_used)
            log.info("ik_llama.cpp KV budget full: a session of %d tokens gave its context up",
                     len(victim.cached_tokens))
            best = victim.context
            self._unbind(victim)  # its context is now the only idle one
            best_length = self._prefixes.longest(tokens, last_n)[1] if self.prefix_cache else 0
        if best is None:
            best = self._prefixes.least_recent()
        if best_length:
            self._prefixes.resumed(best, best_length)  # counts the hit and the tokens it saves
        self._bind(sequence, best)

    # ------------------------------------------------------------------ forward

    def _forward(self, sequences: list[IkSequence], requests: list[list[int]],
                 last_ns: list[int]) -> list[torch.Tensor]:
        self._clock += 1
        results = []
        for sequence, tokens, last_n in zip(sequences, requests, last_ns):  # a pass per session, each alone
            self._context_for(sequence, tokens, last_n, sequences)
            results.append(self._decode(sequence, tokens, last_n))
        return results

    def _decode(self, sequence: IkSequence, tokens: list[int], last_n: int) -> torch.Tensor:
        """The tokens of `tokens` the session's cache lacks, in passes of at most max_pass_tokens and at least
        min_pass_rows rows; the logits of its last `last_n` positions."""
        api = self._api
        sequence.rollback(sequence.reusable_length(tokens, last_n))
        if len(tokens) - len(sequence.cached_tokens) < self.min_pass_rows and sequence.cached_tokens:
            sequence.rollback(len(sequence.cached_tokens) - 1)  # one new token: its pass recomputes the previous cell
        start = len(sequence.cached_tokens)
        fresh = tokens[start:]
        first_wanted = len(fresh) - last_n  # index in `fresh` of the first position whose logits are asked for
        rows = np.empty((last_n, self.vocab_size), dtype=np.float32)
        batch = self._batch
        chunk = 0
        for size in pass_sizes(len(fresh), self.max_pass_tokens):
            part = fresh[chunk:chunk + size]
            # A one-token sequence (nothing cached to recompute): a padding row after it, its cell removed after.
            padding = max(0, self.min_pass_rows - len(part))
            for j, token in enumerate(part + part[-1:] * padding):
                batch.token[j] = token
                batch.pos[j] = start + chunk + j  # cells fill in position order: the layout one-token decoding has
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = SEQ_ID
                # The rows asked for, and at least the last min_pass_rows: the output layer runs on those rows only.
                batch.logits[j] = chunk + j >= first_wanted or j >= len(part) + padding - self.min_pass_rows
            batch.n_tokens = len(part) + padding
            status = api.llama_decode(sequence.context, batch)
            if status != 0:
                sequence.rollback(0)  # a failed decode may leave part of the tokens in the cache
                raise RuntimeError(f"llama_decode failed with status {status}")
            if padding and not self._lib.kv_cache_seq_rm(sequence.context, SEQ_ID, start + chunk + len(part), -1):
                sequence.rollback(0)
                raise RuntimeError("ik_llama.cpp could not remove a padding cell")
            sequence.cached_tokens.extend(part)
            for j in range(max(0, first_wanted - chunk), len(part)):
                rows[chunk + j - first_wanted] = np.ctypeslib.as_array(
                    api.llama_get_logits_ith(sequence.context, j), shape=(self.vocab_size,))
            chunk += size
        sequence.last_used = self._clock
        return torch.from_numpy(rows)

    def _free(self) -> None:
        self._api.llama_batch_free(self._batch)
        global _process_contexts
        with _process_lock:
            for context in self._contexts:
                self._api.llama_free(context)
            _process_contexts -= len(self._contexts)
        self._api.llama_free_model(self._model)


def pass_sizes(tokens: int, most: int) -> list[int]:
    """`tokens` split into the fewest passes of at most `most`, near-equal in size: no pass of one row unless
    `tokens` is 1 (a 32-token prompt in passes of 31 would leave one)."""
    if tokens <= 0:
        return []
    passes = -(-tokens // most)
    base, longer = divmod(tokens, passes)
    return [base + 1] * longer + [base] * (passes - longer)

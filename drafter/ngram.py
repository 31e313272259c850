"""Model-free drafting by prompt lookup (n-gram matching), `drafter serve --method ngram`.

The draft for the next round is a copy of what followed the most recent earlier occurrence of the history's last n
tokens (n = max_ngram down to min_ngram), like HF's `prompt_lookup_num_tokens` and vLLM's ngram speculator. It costs no
model weights and microseconds per call, and pays off where the output quotes its input (refactoring, editing,
summarising with quotes) or repeats itself.

The lookup itself (and its periodic extension past the end of the history) is specmesh/decoding/prompt_lookup.py.

The proposal is deterministic given the history, so under sampling its draft distribution is a point mass on the
proposed token: speculative sampling then accepts token x with probability p(x) and resamples from p without x on
rejection, which keeps the output distributed exactly as the target's. No match: an empty proposal, and the round is
plain target decoding.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from drafter.proposer import Proposal
from specmesh.decoding.prompt_lookup import NgramConfig, NgramIndex
from specmesh.decoding.sampling import SamplingParams, SparseDist
from specmesh.runtime import models
from specmesh.runtime.fingerprint import tokenizer_fingerprint
from specmesh.runtime.models import LoadedModel
from specmesh.runtime.tokenizer import load_tokenizer, tokenizer_dir
from specmesh.wire.contract import Cancelled
from specmesh.wire.history import EMPTY_HASH, TokenHistory
from specmesh.worker.role import ModelDescription
from specmesh.worker.session_store import SessionLimits, SessionStore


NO_DTYPE = "none"  # what Info reports as the dtype of a drafter without weights


# --------------------------------------------------------------------------
# what the drafter reports about "its model": the target's tokenizer, no weights
# --------------------------------------------------------------------------


def ngram_description(name: str, vocab_size: int, eos_token_ids: tuple[int, ...], fingerprint: str,
                      context_limit: int | None) -> ModelDescription:
    """What an n-gram drafter reports in Info: the target's vocabulary (`vocab_size` is the target's logits width:
    ids the verifier may emit, checked on every Propose), and no model runtime, device or weights of its own."""
    return ModelDescription(name=name, vocab_size=vocab_size, fingerprint=fingerprint, eos_token_ids=eos_token_ids,
                            device="cpu", dtype=NO_DTYPE, context_limit=context_limit)


def describe_loaded(loaded: LoadedModel) -> ModelDescription:
    """Borrow tokenizer fingerprint, vocab width and eos ids of an already loaded model (tests, embedding)."""
    return ngram_description(loaded.name, loaded.vocab_size, loaded.eos_token_ids, loaded.fingerprint,
                             getattr(loaded.model.config, "max_position_embeddings", None))


def _tokenizer_width(tokenizer) -> int:
    """Smallest vocabulary that holds every id the tokenizer knows."""
    ids = list(tokenizer.get_vocab().values())
    return max(len(tokenizer), max(ids) + 1 if ids else 0)


def _model_config(spec: str) -> dict | None:
    """The model's config.json, read without loading weights; None when there is none to read."""
    source = models.gguf_source(spec)
    if source is not None:  # load_tokenizer converted the whole model, or the tokenizer with the config
        path = models.converted_dir(source[1], source[2]) / "config.json"
        if not path.is_file():
            path = tokenizer_dir(source[1], source[2]) / "config.json"
    else:
        path = Path(spec).expanduser() / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    try:  # a hub id: the config only, when the hub (or its local cache) is reachable
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(spec).to_dict()
    except Exception:
        return None


def _config_value(config: dict | None, key: str):
    if not config:
        return None
    value = config.get(key)
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get(key)
    return value


def describe_target(spec: str, vocab_size: int | None = None, progress: bool = True) -> ModelDescription:
    """The description of model `spec` (use the target's) read from its tokenizer and config, without its weights.

    The width is `vocab_size` when given, else the model config's vocab_size (read without the weights; tiny presets
    use their padding rule), else the smallest width that holds every tokenizer id.
    """
    tokenizer = load_tokenizer(spec, progress=progress)
    config = None
    if models.is_tiny_preset(spec):
        multiple = models.TINY_VOCAB_MULTIPLE
        width = -(-len(tokenizer) // multiple) * multiple
        max_positions = 2048
    else:
        config = _model_config(spec)
        width = _config_value(config, "vocab_size")
        max_positions = _config_value(config, "max_position_embeddings")
    if vocab_size is not None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        width = vocab_size
    if not width:
        width = _tokenizer_width(tokenizer)
    eos: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), _config_value(config, "eos_token_id")):
        if value is not None:
            eos.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return ngram_description(spec, int(width), tuple(sorted(eos)), tokenizer_fingerprint(tokenizer),
                             int(max_positions) if max_positions else None)


# --------------------------------------------------------------------------
# sessions and the engine
# --------------------------------------------------------------------------


@dataclass
class NgramSession:
    history: TokenHistory
    index: NgramIndex
    num_bytes = 0  # no KV cache: a token list and its index, bounded by the store's count and TTL


class NgramEngine:
    """A Proposer (drafter/proposer.py) drafting by prompt lookup."""

    draft_per_token_s = 0.0  # microseconds: nothing worth measuring

    def __init__(self, description: ModelDescription, limits: SessionLimits = SessionLimits(),
                 config: NgramConfig = NgramConfig()) -> None:
        self.description = description
        self.config = config
        self.sessions = SessionStore(limits, lambda: NgramSession(TokenHistory(), NgramIndex(config)))
        # Sync + lookup take microseconds: one lock keeps a session's history and index consistent under concurrent
        # calls (same session id from a retry) without a lock per session.
        self._lock = threading.Lock()

    def propose(self, session_id: str, base_length: int, base_hash: int, new_tokens: list[int], k: int,
                params: SamplingParams, seed: int, is_active: Callable[[], bool] = lambda: True) -> Proposal:
        if not is_active():
            raise Cancelled("the call was cancelled or its deadline passed before drafting")
        with self._lock:
            session = self.sessions.synced(session_id, base_length, base_hash, new_tokens)
            session.index.update(session.history)
            tokens = tuple(session.index.propose(session.history.tokens, k))
            committed = len(session.history)
        # Deterministic proposal: under sampling q is a point mass on each proposed token (seed is not needed).
        dists = () if params.is_greedy else tuple(SparseDist((t,), (1.0,)) for t in tokens)
        return Proposal(tokens, dists, committed)

    def end_session(self, session_id: str) -> bool:
        return self.sessions.end(session_id)

    def warm_up(self) -> None:
        self.propose("warm-up", 0, EMPTY_HASH, [0, 1, 2, 0, 1], 2, SamplingParams(), 0)
        self.end_session("warm-up")


__all__ = ["NgramEngine", "NgramSession", "describe_loaded", "describe_target", "ngram_description"]

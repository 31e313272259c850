"""The drafter's own settings: the model it drafts with, how (a draft model, or prompt lookup), and how concurrent
sessions share the draft model's forward passes."""

from __future__ import annotations

from dataclasses import dataclass, field

from drafter.ngram import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, NgramConfig
from specmesh.worker.config import BatchingConfig, ModelConfig

METHODS = ("model", "ngram")  # --method: a draft model (drafter/engine.py), prompt lookup (drafter/ngram.py)


@dataclass(frozen=True)
class DrafterConfig:
    model: ModelConfig  # the draft model; with method "ngram", only its name is read: the target's tokenizer
    method: str = "model"
    vocab_size: int | None = None  # ngram: logits width reported (default: the model config's, else the tokenizer's)
    ngram_min: int | None = None  # ngram: shortest n-gram matched (default: DEFAULT_MIN_NGRAM)
    ngram_max: int | None = None  # ngram: longest n-gram matched (default: DEFAULT_MAX_NGRAM)
    batching: BatchingConfig = field(default_factory=BatchingConfig)  # model: cross-session draft steps

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown drafting method {self.method!r}; expected one of {', '.join(METHODS)}")
        if self.method != "ngram":
            given = [name for name, value in (("vocab_size", self.vocab_size), ("ngram_min", self.ngram_min),
                                              ("ngram_max", self.ngram_max)) if value is not None]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to the ngram method (--method ngram)")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        self.ngram_config()  # its bounds are checked now, not first when the server loads

    def ngram_config(self) -> NgramConfig:
        return NgramConfig(min_ngram=self.ngram_min if self.ngram_min is not None else DEFAULT_MIN_NGRAM,
                           max_ngram=self.ngram_max if self.ngram_max is not None else DEFAULT_MAX_NGRAM)

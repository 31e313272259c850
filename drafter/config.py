"""The drafter's own settings: the model it drafts with, how (a draft model, prompt lookup or SuffixDecoding), and how
concurrent sessions share the draft model's forward passes."""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.decoding.prompt_lookup import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, NgramConfig
from drafter.suffix import SuffixConfig
from specmesh.worker.config import BatchingConfig, ModelConfig

# --method: a draft model (drafter/engine.py), prompt lookup (drafter/ngram.py), SuffixDecoding (drafter/suffix.py)
METHODS = ("model", "ngram", "suffix")
WEIGHTLESS = ("ngram", "suffix")  # no weights loaded: --model only names the tokenizer (the target's)
SUFFIX_FIELDS = ("suffix_max_depth", "suffix_max_tokens", "suffix_max_requests", "suffix_spec_factor",
                 "suffix_min_prob", "suffix_index_prompts")


@dataclass(frozen=True)
class DrafterConfig:
    model: ModelConfig  # the draft model; ngram, suffix: only its name is read, the target's tokenizer
    method: str = "model"
    vocab_size: int | None = None  # ngram, suffix: logits width reported (default: model config's, else tokenizer's)
    ngram_min: int | None = None  # ngram: shortest n-gram matched (default: DEFAULT_MIN_NGRAM)
    ngram_max: int | None = None  # ngram: longest n-gram matched (default: DEFAULT_MAX_NGRAM)
    # suffix (None: SuffixConfig's defaults): the trees' depth, the global tree's bounds, draft length and cut-off
    suffix_max_depth: int | None = None
    suffix_max_tokens: int | None = None
    suffix_max_requests: int | None = None
    suffix_spec_factor: float | None = None
    suffix_min_prob: float | None = None
    suffix_index_prompts: bool = False
    batching: BatchingConfig = field(default_factory=BatchingConfig)  # model: cross-session draft steps

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown drafting method {self.method!r}; expected one of {', '.join(METHODS)}")
        if self.method not in WEIGHTLESS and self.vocab_size is not None:
            raise ValueError("vocab_size only apply to the ngram method (--method ngram) and the suffix method "
                             "(--method suffix)")
        if self.method != "ngram":
            given = [name for name in ("ngram_min", "ngram_max") if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to the ngram method (--method ngram)")
        if self.method != "suffix":
            given = [name for name in SUFFIX_FIELDS if getattr(self, name) not in (None, False)]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to the suffix method (--method suffix)")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        self.ngram_config()  # its bounds are checked now, not first when the server loads
        self.suffix_config()

    def ngram_config(self) -> NgramConfig:
        return NgramConfig(min_ngram=self.ngram_min if self.ngram_min is not None else DEFAULT_MIN_NGRAM,
                           max_ngram=self.ngram_max if self.ngram_max is not None else DEFAULT_MAX_NGRAM)

    def suffix_config(self) -> SuffixConfig:
        given = {name.removeprefix("suffix_"): getattr(self, name) for name in SUFFIX_FIELDS
                 if getattr(self, name) is not None}
        return SuffixConfig(**given)

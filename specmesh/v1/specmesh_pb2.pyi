from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ...) -> None: ...

class ContextSync(_message.Message):
    __slots__ = ("base_length", "base_hash", "new_tokens")
    BASE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BASE_HASH_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    base_length: int
    base_hash: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, base_length: _Optional[int] = ..., base_hash: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "context", "num_tokens", "sampling", "seed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    context: ContextSync
    num_tokens: int
    sampling: SamplingParams
    seed: int
    def __init__(self, session_id: _Optional[str] = ..., context: _Optional[_Union[ContextSync, _Mapping]] = ..., num_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tokens", "distributions", "committed_length")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    committed_length: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., committed_length: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "context", "draft_tokens", "draft_distributions", "sampling", "seed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    context: ContextSync
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    sampling: SamplingParams
    seed: int
    def __init__(self, session_id: _Optional[str] = ..., context: _Optional[_Union[ContextSync, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted", "next_token", "committed_length")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    next_token: int
    committed_length: int
    def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., committed_length: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "context", "max_tokens", "stop_token_ids", "sampling", "seed", "flush_interval_ms", "guess")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FLUSH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    GUESS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    context: ContextSync
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    seed: int
    flush_interval_ms: int
    guess: bool
    def __init__(self, session_id: _Optional[str] = ..., context: _Optional[_Union[ContextSync, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., flush_interval_ms: _Optional[int] = ..., guess: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token", "committed_length", "more_tokens", "guesses", "guesses_accepted")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GUESSES_FIELD_NUMBER: _ClassVar[int]
    GUESSES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    token: int
    committed_length: int
    more_tokens: _containers.RepeatedScalarFieldContainer[int]
    guesses: int
    guesses_accepted: int
    def __init__(self, token: _Optional[int] = ..., committed_length: _Optional[int] = ..., more_tokens: _Optional[_Iterable[int]] = ..., guesses: _Optional[int] = ..., guesses_accepted: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_name", "vocab_size", "tokenizer_fingerprint", "eos_token_ids", "device", "dtype", "max_draft_tokens", "max_context_length", "role", "active_sessions", "engine", "resident_bytes", "weights_bytes", "draft_per_token_s", "verify_base_s", "verify_per_draft_s", "verify_costs", "prefix_cache_hits", "prefix_cache_reused_tokens", "deterministic", "engine_build")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_BASE_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_PER_DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COSTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BUILD_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    dtype: str
    max_draft_tokens: int
    max_context_length: int
    role: str
    active_sessions: int
    engine: str
    resident_bytes: int
    weights_bytes: int
    draft_per_token_s: float
    verify_base_s: float
    verify_per_draft_s: float
    verify_costs: _containers.RepeatedCompositeFieldContainer[VerifyCost]
    prefix_cache_hits: int
    prefix_cache_reused_tokens: int
    deterministic: bool
    engine_build: str
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_draft_tokens: _Optional[int] = ..., max_context_length: _Optional[int] = ..., role: _Optional[str] = ..., active_sessions: _Optional[int] = ..., engine: _Optional[str] = ..., resident_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., draft_per_token_s: _Optional[float] = ..., verify_base_s: _Optional[float] = ..., verify_per_draft_s: _Optional[float] = ..., verify_costs: _Optional[_Iterable[_Union[VerifyCost, _Mapping]]] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_reused_tokens: _Optional[int] = ..., deterministic: _Optional[bool] = ..., engine_build: _Optional[str] = ...) -> None: ...

class VerifyCost(_message.Message):
    __slots__ = ("drafts", "seconds")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    drafts: int
    seconds: float
    def __init__(self, drafts: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

"""The verifier's own settings: the model it runs, and how concurrent sessions share its forward passes."""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.worker.config import ModelConfig


@dataclass(frozen=True)
class BatchingConfig:
    # Verify calls of different sessions run together as one forward pass of up to this many sessions (1: never).
    max_batch_size: int = 8
    # How long a pass may wait for recently answered sessions' next calls to join it (0: never waits).
    max_batch_wait_s: float = 0.02

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 <= self.max_batch_wait_s <= 10:
            raise ValueError(f"max_batch_wait_s must be in 0..10 seconds, got {self.max_batch_wait_s}")


@dataclass(frozen=True)
class VerifierConfig:
    model: ModelConfig  # the target model
    batching: BatchingConfig = field(default_factory=BatchingConfig)

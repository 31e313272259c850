"""The verifier's own settings: the model it runs, and how concurrent sessions share its forward passes."""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.worker.config import BatchingConfig, ModelConfig


@dataclass(frozen=True)
class VerifierConfig:
    model: ModelConfig  # the target model
    batching: BatchingConfig = field(default_factory=BatchingConfig)

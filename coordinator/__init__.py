"""The specmesh coordinator: the accept/reject loop over remote drafter and verifier services, and the CLI."""

from coordinator.api import Coordinator, GenerationOptions, GenerationResult

__all__ = ["Coordinator", "GenerationOptions", "GenerationResult"]

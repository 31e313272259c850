"""The specmesh coordinator: the accept/reject loop over remote drafter and verifier services, and the CLI."""

__all__ = ["Coordinator", "GenerationOptions", "GenerationResult"]


def __getattr__(name: str):
    # Imported on first use: `coordinator models list` should not pay for importing torch and transformers.
    if name in __all__:
        from coordinator import api
        return getattr(api, name)
    raise AttributeError(f"module 'coordinator' has no attribute {name!r}")

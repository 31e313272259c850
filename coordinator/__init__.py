"""The specmesh coordinator: the accept/reject loop over remote drafter and verifier services, its Python API, the
OpenAI-compatible HTTP service and the CLI. A client of the workers: it imports specmesh's wire/, decoding/, ops/ and
the tokenizer, never the worker server (specmesh/worker/), a model engine or the benchmarks. Its rooms:

  The loop and its API (this folder)
    api.py              the Python API: Coordinator, GenerationOptions, GenerationResult (re-exported here, lazily)
    loop.py             the speculative decoding loop, flat and gRPC-free
    cli.py              `coordinator generate|serve|models|bench|bench-serve|bench-concurrency`; __main__.py runs it
    translation.py      drafting across tokenizers, through text
    text_stream.py      incremental detokenisation and stop strings
    cancel.py           cancelling a generation from outside (the API, the fleet and serving share it)
    stream_flush.py     how long a verifier may hold target-only tokens before sending them
    record.py           --record: one JSON line per generation

  drafting/             the drafting decision: cost model, estimators, policies, per-source learning, hybrid
  fleet/                the workers: pools, remote sessions, retries, failover, breakers, local worker processes
  serving/              the OpenAI-compatible HTTP service and its admission control

The benchmark commands (`coordinator bench`, `bench-serve`, `bench-concurrency`) live in the top-level package
specmesh_bench/, which may import engines; cli.py hands those commands to it when one is run.
"""

__all__ = ["Coordinator", "GenerationOptions", "GenerationResult"]


def __getattr__(name: str):
    # Imported on first use: `coordinator models list` should not pay for importing torch and transformers.
    if name in __all__:
        from coordinator import api
        return getattr(api, name)
    raise AttributeError(f"module 'coordinator' has no attribute {name!r}")

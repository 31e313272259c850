"""The specmesh coordinator: the accept/reject loop over remote drafter and verifier services, its Python API, the
OpenAI-compatible HTTP service and the CLI. A client of the workers: it imports specmesh's wire/, decoding/, ops/ and
the tokenizer, never the worker server (specmesh/worker/) or a model engine. Its modules, by concern:

  The loop and the draft policy
    api.py              the Python API: Coordinator, GenerationOptions, GenerationResult (re-exported here, lazily)
    loop.py             the speculative decoding loop, flat and gRPC-free
    drafting/           the drafting decision: cost model, estimators, policies, per-source learning, hybrid
    translation.py      drafting across tokenizers, through text
    text_stream.py      incremental detokenisation and stop strings
    record.py           --record: one JSON line per generation

  The remote sessions and the fleet
    remote_sessions.py  one generation's drafter and verifier sessions: retries, failover, degradation
    fleet.py            pools of workers: health watching, circuit breakers, spreading sessions
    resilience.py       deadlines, retries and circuit breakers
    channel.py          what every client of a worker shares: channel options, session ids, history sync
    worker_client.py    one worker's channel, stubs and health, WorkerError
    connect_errors.py   why a worker cannot be reached, in words that name the fix
    cancel.py           cancelling a generation from outside
    polling.py          the wait-until loop behind every "wait until SERVING"

  The HTTP service
    http_api.py         /v1/completions, /v1/chat/completions, /v1/models, /health (FastAPI)
    http_server.py      uvicorn with a drain on SIGTERM
    admission.py        how many generations run and wait at once; 429 beyond

  The command line
    cli.py              `coordinator generate|serve|models|bench|bench-concurrency`; __main__.py runs it
    local_workers.py    drafter and verifier subprocesses for a command given no addresses
    benchmarks/         the benchmark commands (its own docstring lists its modules)
"""

__all__ = ["Coordinator", "GenerationOptions", "GenerationResult"]


def __getattr__(name: str):
    # Imported on first use: `coordinator models list` should not pay for importing torch and transformers.
    if name in __all__:
        from coordinator import api
        return getattr(api, name)
    raise AttributeError(f"module 'coordinator' has no attribute {name!r}")

"""The verifier service: the target model checking k draft tokens in one forward pass over gRPC, on the worker
server (specmesh/worker/).

    cli.py          `verifier serve`: the worker's shared flags plus the verifier's own; __main__.py runs it
    config.py       the verifier's settings: the model it runs, batching across sessions
    service.py      the Verifier gRPC servicer and the verifier's role on the worker server
    engine.py       verification in one target forward pass on a session's KV cache, batched across sessions
"""

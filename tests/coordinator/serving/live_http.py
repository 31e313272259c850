"""Running an HTTP app (coordinator/serving/http_api.py) in a thread on an ephemeral loopback port, for tests."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from prometheus_client import REGISTRY

from coordinator.serving.http_server import DrainingServer


@contextmanager
def serving(app, grace_s: float = 30.0) -> Iterator[tuple[str, DrainingServer]]:
    """(base URL, server) of `app` served by the CLI's server class; stopped on exit."""
    listener = socket.create_server(("127.0.0.1", 0))
    server = DrainingServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5),
                            app.state.completions, grace_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        thread.join(0.02)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(15)


def sample(name: str, **labels: str) -> float:
    """A Prometheus sample of this process (0 when it has not been recorded yet)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0

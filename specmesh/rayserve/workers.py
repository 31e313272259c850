"""Verifier and drafter replicas: each runs the ordinary worker (gRPC server, engine, prefix cache) in its Ray actor.

Ray places a replica on a node with the resources it asks for (config.Placement) and starts it there; the replica
binds its gRPC server on that node's address (a free port), loads the model and only then finishes its constructor,
so Serve counts it as running once it can serve. `describe` tells the coordinator (a broadcast over the deployment:
ingress.py) where it listens. When Ray stops a replica (scaling down, a redeploy) the server reports NOT_SERVING and
lets its calls in flight finish for `grace_s`; the coordinator moves the sessions on at their next call. When its node
dies, the process dies with it, and Serve starts a replacement wherever the resources are.
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack

from specmesh.rayserve.autoscaling import ONGOING_GENERATIONS
from specmesh.rayserve.config import WorkerSettings

log = logging.getLogger("specmesh.rayserve")


def node_address() -> str:
    """The IP address Ray knows this node by (what other nodes reach it at)."""
    import ray
    return ray.util.get_node_ip_address()


class WorkerReplica:
    role = ""

    def __init__(self, model_options: dict, worker: WorkerSettings, token_file: str | None = None) -> None:
        import ray

        from specmesh.wire.security import load_token
        host = node_address() if worker.host == "node" else worker.host
        options = dict(model_options, host=host, token=load_token(token_file))
        if worker.threads is not None:
            options["threads"] = worker.threads
        if worker.inject_latency_s:
            options["inject_latency_s"] = worker.inject_latency_s
        self._grace_s = worker.grace_s
        self._stack = ExitStack()
        self.server = self._stack.enter_context(self._run_server(port=0, **options))
        self._node_id = ray.get_runtime_context().get_node_id()
        log.info("%s replica serving on %s (node %s, pid %d)", self.role, self.server.address, self._node_id[:8],
                 os.getpid())

    def _run_server(self, **options):
        raise NotImplementedError

    def describe(self) -> dict:
        """Where this replica's worker listens, and what it holds."""
        engine = self.server.engine
        return {"address": self.server.address, "role": self.role, "node_id": self._node_id, "pid": os.getpid(),
                "sessions": len(engine.sessions) if engine is not None else 0}

    def check_health(self) -> None:
        """Serve's health check: a worker that stopped serving makes Serve replace the replica."""
        if self.server.terminated.is_set() or self.server.engine is None:
            raise RuntimeError(f"the {self.role} worker on {self.server.address} is not serving")

    def __del__(self) -> None:
        stack = getattr(self, "_stack", None)
        if stack is not None:
            self.server.stop(grace=self._grace_s)
            stack.close()


class VerifierReplica(WorkerReplica):
    role = "verifier"

    def _run_server(self, **options):
        from verifier.service import run_server
        model = options.pop("model")
        return run_server(model, **options)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric: the generations this replica serves (its open sessions). Their
        requests reach it over gRPC, past Serve's own count of ongoing requests."""
        engine = self.server.engine
        return {ONGOING_GENERATIONS: float(len(engine.sessions)) if engine is not None else 0.0}


class DrafterReplica(WorkerReplica):
    role = "drafter"

    def _run_server(self, **options):
        from drafter.service import run_server
        model = options.pop("model")
        return run_server(model, **options)

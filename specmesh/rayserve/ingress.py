"""The coordinator deployment: the OpenAI-compatible HTTP ingress over the verifier and drafter replicas.

It serves the very app of `coordinator serve` (coordinator/serving/http_api.py) over a Coordinator whose pools are fed by
Ray instead of a static list: every `discovery_interval_s` it broadcasts `describe` to the worker deployments (Serve
sends it to each replica it counts as running) and hands the addresses to the pools (WorkerPool.set_addresses). A
replica Ray started joins; one Ray stopped, or whose node died, leaves, and its sessions move to another verifier,
which rebuilds their KV caches from the token history: the fleet logic (health watching, breakers, prefix affinity,
failover) is the coordinator's own, as with any fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from ray import serve
from ray.serve.handle import DeploymentHandle

log = logging.getLogger("specmesh.rayserve")

BROADCAST_TIMEOUT_S = 10.0  # a replica that does not answer in this long is left out of this round


async def live_addresses(handle: DeploymentHandle, timeout_s: float = BROADCAST_TIMEOUT_S) -> list[str]:
    """The gRPC addresses of the deployment's running replicas that answer (a dead one's error is left out)."""
    replies = await handle.broadcast("describe").results_async(timeout_s=timeout_s, return_exceptions=True)
    return sorted({r["address"] for r in replies if isinstance(r, dict) and "address" in r})


@serve.ingress()
class CoordinatorIngress:
    async def __init__(self, verifiers: DeploymentHandle, drafters: DeploymentHandle | None,
                       serve_args: argparse.Namespace, discovery_interval_s: float) -> None:
        from coordinator.api import Coordinator
        from coordinator.cli import resilience_from, security_from
        from specmesh.ops.logs import configure_logging
        from specmesh.ops.metrics import serve_metrics
        configure_logging("coordinator", serve_args.log_format, serve_args.log_level)
        self.args, self.interval_s = serve_args, discovery_interval_s
        self.handles = {"verifier": verifiers, **({"drafter": drafters} if drafters is not None else {})}
        found = {role: await self._wait_for(role) for role in self.handles}
        serve_metrics(serve_args.metrics_port, serve_args.metrics_host)
        args = serve_args
        self.coordinator = await asyncio.to_thread(
            Coordinator, verifier=found["verifier"], drafter=found.get("drafter"),
            resilience=resilience_from(args), security=security_from(args), record=args.record,
            connect_timeout_s=args.connect_timeout, unreachable_timeout_s=args.unreachable_timeout)
        self.pools = {"verifier": self.coordinator.verifiers, "drafter": self.coordinator.drafters}
        self._discovery = asyncio.get_running_loop().create_task(self._discover())

    async def _wait_for(self, role: str) -> list[str]:
        """The first addresses of a role's replicas (Serve starts the deployments side by side)."""
        while True:
            addresses = await self._addresses(role)
            if addresses:
                log.info("%s replicas on Ray: %s", role, ", ".join(addresses))
                return addresses
            await asyncio.sleep(self.interval_s)

    async def _addresses(self, role: str) -> list[str]:
        try:
            return await live_addresses(self.handles[role])
        except Exception as e:  # noqa: BLE001 - Serve not answering this round: keep the pool as it is
            log.warning("could not list the %s replicas: %s", role, e)
            return []

    async def _discover(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for role in self.handles:
                addresses = await self._addresses(role)
                pool = self.pools[role]
                if addresses and pool is not None:
                    # Retired endpoints are closed once unused: a call that can block on a gRPC channel's close.
                    added, retired = await asyncio.to_thread(pool.set_addresses, addresses)
                    if added or retired:
                        log.info("%s pool: joined %s, left %s; now %s", role, added or "-", retired or "-",
                                 ", ".join(addresses))

    def __serve_build_asgi_app__(self):
        from coordinator.serving.admission import AdmissionConfig
        from coordinator.serving.http_api import create_app
        args = self.args
        return create_app(self.coordinator, default_max_tokens=args.default_max_tokens,
                          draft_tokens=args.draft_tokens, draft_policy=args.draft_policy, pipeline=args.pipeline,
                          admission=AdmissionConfig(max_active=args.max_concurrent_requests,
                                                    max_queue=args.max_queue),
                          stream_flush_s=args.stream_flush_ms / 1000)

    def fleet(self) -> dict:
        """What the coordinator's pools hold now: {role: [{address, serving, retired, sessions}]} (for operators
        and the smoke run, through a handle)."""
        return {role: [{"address": e.address, "serving": e.serving, "retired": e.retired, "sessions": e.sessions}
                       for e in pool.endpoints]
                for role, pool in self.pools.items() if pool is not None}

    def __del__(self) -> None:
        discovery = getattr(self, "_discovery", None)
        if discovery is not None:
            discovery.cancel()
        coordinator = getattr(self, "coordinator", None)
        if coordinator is not None:
            coordinator.close()

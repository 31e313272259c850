"""The client side of one drafter or verifier service: its channel, stubs and health, and the few calls the
coordinator makes outside a generation (Info, EndSession, waiting until it is SERVING)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.fleet.channel import CHANNEL_OPTIONS
from coordinator.drafting.priors import measures_costs_later
from coordinator.fleet.polling import wait_until
from specmesh.wire.security import ClientSecurity, load_token
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc


class WorkerError(RuntimeError):
    """A worker could not be started, reached or used."""


class RemoteWorker:
    """A channel to one drafter or verifier with its stub and health stub."""

    def __init__(self, address: str, role: str, security: ClientSecurity | None = None,
                 options: list = CHANNEL_OPTIONS) -> None:
        self.address, self.role = address, role
        security = security if security is not None else ClientSecurity(token=load_token())
        self.channel = security.channel(address, options)
        self.stub = (pb_grpc.DrafterStub if role == "drafter" else pb_grpc.VerifierStub)(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def info(self, timeout_s: float = 10.0) -> pb.InfoResponse:
        try:
            return self.stub.Info(pb.InfoRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise WorkerError(f"{self.role} at {self.address}: Info failed: {e.code().name} {e.details()}") from e

    def is_serving(self, timeout_s: float = 2.0) -> bool:
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def wait_serving(self, timeout_s: float, on_wait: Callable[[], None] | None = None) -> None:
        """Poll health until SERVING; WorkerError after `timeout_s`. `on_wait` runs between polls (and may raise)."""
        if not wait_until(self.is_serving, timeout_s, interval_s=0.25, on_wait=on_wait):
            raise WorkerError(f"{self.role} at {self.address} not SERVING after {timeout_s:.0f} s")

    def wait_costs(self, timeout_s: float, on_wait: Callable[[], None] | None = None) -> pb.InfoResponse:
        """Poll Info until the worker reports its costs (measured after SERVING when they are not cached), and return
        it; WorkerError after `timeout_s`. `on_wait` runs between polls (and may raise)."""
        infos = []

        def measured() -> bool:
            infos.append(self.info())
            return not measures_costs_later(infos[-1])
        if not wait_until(measured, timeout_s, interval_s=0.05, on_wait=on_wait):
            raise WorkerError(f"{self.role} at {self.address} has not measured its costs after {timeout_s:.0f} s")
        return infos[-1]

    def end_session(self, session_id: str) -> None:
        try:
            self.stub.EndSession(pb.EndSessionRequest(session_id=session_id), timeout=2.0)
        except grpc.RpcError:
            pass  # best effort: idle sessions expire on the server anyway

    def close(self) -> None:
        self.channel.close()

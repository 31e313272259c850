"""The worker server with a fake role (no model): what it takes from the role and its engine, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
from specmesh.wire.history import EMPTY_HASH, TokenHistory
from specmesh.worker.config import ServerConfig
from specmesh.worker.role import ModelDescription
from specmesh.worker.server import WorkerServer, WorkerServicerBase, serving
from specmesh.worker.session_store import SessionLimits, SessionStore

DESCRIPTION = ModelDescription(name="fake-model", vocab_size=123, fingerprint="f" * 64, eos_token_ids=(7, 9),
                               device="cpu", dtype="float32", context_limit=500, engine="fake",
                               weights_bytes=4096, linear_backend="torch")


@dataclass
class FakeSession:
    history: TokenHistory
    num_bytes: int = 10


class FakeEngine:
    def __init__(self, description: ModelDescription) -> None:
        self.description = description
        self.sessions = SessionStore(SessionLimits(), lambda: FakeSession(TokenHistory()))
        self.warmed_up = False
        self.ended: list[str] = []

    def warm_up(self) -> None:
        self.warmed_up = True

    def end_session(self, session_id: str) -> bool:
        self.ended.append(session_id)
        return self.sessions.end(session_id)


class InfoOnlyServicer(WorkerServicerBase, pb_grpc.VerifierServicer):
    """Info and EndSession from the base; Verify left unimplemented."""


class FakeRole:
    name = "verifier"
    service_name = "specmesh.v1.Verifier"

    def __init__(self, description: ModelDescription = DESCRIPTION) -> None:
        self.description = description
        self.engine: FakeEngine | None = None

    def add_servicer(self, worker, server) -> None:
        pb_grpc.add_VerifierServicer_to_server(InfoOnlyServicer(worker), server)

    def build_engine(self, config: ServerConfig) -> FakeEngine:
        self.engine = FakeEngine(self.description)
        return self.engine

    def info_fields(self, engine: FakeEngine) -> dict[str, float]:
        return {"verify_base_s": 0.25, "verify_per_draft_s": 0.5}


def health_of(channel, service: str) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_info_reports_the_description_the_role_fields_and_the_agreed_limits():
    role = FakeRole()
    with serving(WorkerServer(role, ServerConfig(max_draft_tokens=5, max_context_length=10_000))) as server, \
            grpc.insecure_channel(server.address) as channel:
        role.engine.sessions.synced("someone/s", 0, EMPTY_HASH, [1, 2])
        info = pb_grpc.VerifierStub(channel).Info(pb.InfoRequest(), timeout=5)
    assert role.engine.warmed_up
    assert (info.model_name, info.vocab_size, info.tokenizer_fingerprint, list(info.eos_token_ids)) == (
        "fake-model", 123, "f" * 64, [7, 9])
    assert (info.device, info.dtype, info.engine, info.weights_bytes, info.role) == (
        "cpu", "float32", "fake", 4096, "verifier")
    assert (info.max_draft_tokens, info.max_context_length) == (5, 500)  # the model's limit is below the config's
    assert info.active_sessions == 1 and info.resident_bytes > 0
    assert (info.verify_base_s, info.verify_per_draft_s, info.draft_per_token_s) == (0.25, 0.5, 0.0)


@pytest.mark.parametrize("configured, model_limit, agreed", [(64, 500, 64), (None, 500, 500), (None, None, 2**31 - 1)])
def test_context_limit_is_the_smaller_of_config_and_model(configured, model_limit, agreed):
    role = FakeRole(ModelDescription("m", 10, "f", (), "cpu", "none", context_limit=model_limit))
    with serving(WorkerServer(role, ServerConfig(max_context_length=configured))) as server:
        assert server.max_context_length == agreed


def test_end_session_goes_to_the_engine_under_the_callers_namespace():
    role = FakeRole()
    with serving(WorkerServer(role)) as server, grpc.insecure_channel(server.address) as channel:
        role.engine.sessions.synced("/s", 0, EMPTY_HASH, [1])
        stub = pb_grpc.VerifierStub(channel)
        assert stub.EndSession(pb.EndSessionRequest(session_id="s"), timeout=5).existed
        assert not stub.EndSession(pb.EndSessionRequest(session_id="s"), timeout=5).existed
    assert role.engine.ended == ["/s", "/s"]  # no token, no certificate: the anonymous namespace


def test_not_serving_and_unavailable_until_the_engine_is_loaded():
    role = FakeRole()
    server = WorkerServer(role)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            assert health_of(channel, "") == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as error:
                pb_grpc.VerifierStub(channel).Info(pb.InfoRequest(), timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            server.load()
            assert health_of(channel, "") == health_of(channel, role.service_name) == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(grace=0)

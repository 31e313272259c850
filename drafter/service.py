"""The Drafter gRPC service."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from drafter.engine import DraftEngine
from specmesh.models import LoadedModel
from specmesh.serving import WorkerConfig, WorkerServer, WorkerServicerBase, rpc, serving
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
from specmesh.validation import check_context, check_session_id, sampling_from_wire

SERVICE_NAME = "specmesh.v1.Drafter"


class DrafterServicer(WorkerServicerBase, pb_grpc.DrafterServicer):
    @rpc
    def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        engine: DraftEngine = self.engine
        config = self.worker.config
        check_session_id(request.session_id)
        if not 1 <= request.num_tokens <= config.max_draft_tokens:
            raise ValueError(f"num_tokens must be in 1..{config.max_draft_tokens}, got {request.num_tokens}")
        new_tokens = list(request.context.new_tokens)
        check_context(request.context.base_length, new_tokens, engine.loaded.vocab_size,
                      self.worker.max_context_length - request.num_tokens)
        params = sampling_from_wire(request.sampling.temperature, request.sampling.top_k, request.sampling.top_p)
        self.before_work(context)
        proposal = engine.propose(request.session_id, request.context.base_length, request.context.base_hash,
                                  new_tokens, request.num_tokens, params, request.seed, is_active=context.is_active)
        return pb.ProposeResponse(
            tokens=list(proposal.tokens),
            distributions=[pb.SparseDistribution(token_ids=list(d.token_ids), probs=list(d.probs))
                           for d in proposal.dists],
            committed_length=proposal.committed_length)


def build_server(config: WorkerConfig, preloaded: LoadedModel | None = None) -> WorkerServer:
    return WorkerServer(config, lambda loaded, server: DraftEngine(loaded, server.config.limits), DrafterServicer,
                        pb_grpc.add_DrafterServicer_to_server, SERVICE_NAME, preloaded)


@contextmanager
def run_server(model: str | LoadedModel, port: int = 0, **options) -> Iterator[WorkerServer]:
    """A started, warmed-up drafter on `port` (0 = ephemeral); stopped on exit. For tests and embedding."""
    preloaded = model if isinstance(model, LoadedModel) else None
    config = WorkerConfig(model=preloaded.name if preloaded else model, role="drafter", port=port, **options)
    with serving(build_server(config, preloaded)) as server:
        yield server

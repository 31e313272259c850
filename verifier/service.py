"""The Verifier gRPC service and the verifier's role on the worker server."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from specmesh.runtime.models import LoadedModel
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.wire.contract import NotReady
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
from specmesh.wire.limits import MAX_FLUSH_INTERVAL_MS
from specmesh.wire.validation import check_context, check_token_ids, dist_from_wire, sampling_from_wire
from specmesh.worker.config import FaultInjection, ModelConfig, ServerConfig, split_options
from specmesh.worker.server import WorkerServer, WorkerServicerBase, rpc, rpc_stream, serving
from verifier.config import BatchingConfig, VerifierConfig
from verifier.decode_stream import DecodeSteps, decode_stream
from verifier.engine import VerifyEngine

SERVICE_NAME = "specmesh.v1.Verifier"


class VerifierServicer(WorkerServicerBase, pb_grpc.VerifierServicer):
    @rpc
    def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        engine: VerifyEngine = self.engine
        vocab_size = engine.description.vocab_size
        session_key = self.session_key(request.session_id, context)
        drafts = list(request.draft_tokens)
        if len(drafts) > self.worker.config.max_draft_tokens:
            raise ValueError(f"{len(drafts)} draft tokens exceed max_draft_tokens {self.worker.config.max_draft_tokens}")
        check_token_ids("draft_tokens", drafts, vocab_size)
        new_tokens = list(request.context.new_tokens)
        # +1: the verifier always adds one token of its own.
        check_context(request.context.base_length, new_tokens, vocab_size,
                      self.worker.max_context_length - len(drafts) - 1)
        params = sampling_from_wire(request.sampling.temperature, request.sampling.top_k, request.sampling.top_p)
        dists = [dist_from_wire(i, d.token_ids, d.probs, vocab_size)
                 for i, d in enumerate(request.draft_distributions)]
        if params.is_greedy and dists:
            raise ValueError("draft_distributions must be empty for greedy decoding")
        if not params.is_greedy and len(dists) != len(drafts):
            raise ValueError(f"sampling needs one draft distribution per draft token: {len(dists)} for {len(drafts)}")
        for i, (token, dist) in enumerate(zip(drafts, dists)):
            if dist.prob_of(token) <= 0:
                raise ValueError(f"draft_tokens[{i}] = {token} has probability 0 in its own draft distribution")
        self.before_work(context)
        outcome = engine.verify(session_key, request.context.base_length, request.context.base_hash,
                                new_tokens, drafts, dists, params, request.seed, is_active=context.is_active)
        return pb.VerifyResponse(accepted=outcome.verdict.accepted, next_token=outcome.verdict.next_token,
                                 committed_length=outcome.committed_length)


    @rpc_stream
    def Decode(self, request: pb.DecodeRequest, context) -> Iterator[pb.DecodeResponse]:
        engine: VerifyEngine = self.engine
        vocab_size = engine.description.vocab_size
        session_key = self.session_key(request.session_id, context)
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if request.flush_interval_ms > MAX_FLUSH_INTERVAL_MS:
            raise ValueError(f"flush_interval_ms must be at most {MAX_FLUSH_INTERVAL_MS}, got "
                             f"{request.flush_interval_ms}")
        check_token_ids("stop_token_ids", list(request.stop_token_ids), vocab_size)
        new_tokens = list(request.context.new_tokens)
        # Every step adds one token: the whole stream must fit in the context.
        limit = self.worker.max_context_length - request.max_tokens
        if limit < 0:
            raise ValueError(f"max_tokens {request.max_tokens} exceeds max_context_length "
                             f"{self.worker.max_context_length}")
        check_context(request.context.base_length, new_tokens, vocab_size, limit)
        params = sampling_from_wire(request.sampling.temperature, request.sampling.top_k, request.sampling.top_p)
        steps = DecodeSteps(session_key, request.context.base_length, request.context.base_hash, tuple(new_tokens),
                            request.max_tokens, frozenset(request.stop_token_ids), params, request.seed,
                            request.flush_interval_ms / 1000, request.guess)

        def before_step() -> None:
            if self.worker.stopping.is_set():  # draining: the client goes on elsewhere from what it has received
                raise NotReady("the verifier is stopping")
            self.before_work(context)  # each step counts as a call for injected faults (tests), as a Verify would

        for outcomes in decode_stream(engine, steps, context.is_active, before_step):
            tokens = [token for outcome in outcomes for token in outcome.committed]
            yield pb.DecodeResponse(token=tokens[0], more_tokens=tokens[1:],
                                    committed_length=outcomes[-1].committed_length,
                                    guesses=sum(o.guesses for o in outcomes),
                                    guesses_accepted=sum(len(o.accepted_guesses) for o in outcomes))


class VerifierRole:
    """The verifier on the worker server (a WorkerRole, specmesh/worker/role.py)."""

    name = "verifier"
    service_name = SERVICE_NAME

    def __init__(self, config: VerifierConfig, preloaded: LoadedModel | None = None) -> None:
        self.config = config
        self._preloaded = preloaded  # tests and embedding: a model already in memory instead of config.model

    def add_servicer(self, worker: WorkerServer, server: grpc.Server) -> None:
        pb_grpc.add_VerifierServicer_to_server(VerifierServicer(worker), server)

    def build_engine(self, config: ServerConfig) -> VerifyEngine:
        return VerifyEngine(self.config.model.load(config, self._preloaded), config.limits, self.config.batching)

    def info_fields(self, engine: VerifyEngine) -> dict:
        return {"verify_base_s": engine.verify_base_s, "verify_per_draft_s": engine.verify_per_draft_s,
                "verify_costs": [pb.VerifyCost(drafts=k, seconds=s) for k, s in engine.verify_costs]}


@contextmanager
def run_server(model: str | LoadedModel, port: int = 0, **options) -> Iterator[WorkerServer]:
    """A started, warmed-up verifier on `port` (0 = ephemeral); stopped on exit. For tests and embedding. `options`:
    fields of ServerConfig, ModelConfig (but `model`), BatchingConfig and FaultInjection."""
    preloaded = model if isinstance(model, LoadedModel) else None
    server_options, model_options, batching, faults = split_options(options, ServerConfig, ModelConfig,
                                                                    BatchingConfig, FaultInjection)
    config = VerifierConfig(ModelConfig(preloaded.name if preloaded else model, **model_options),
                            BatchingConfig(**batching))
    server = WorkerServer(VerifierRole(config, preloaded), ServerConfig(port=port, **server_options),
                          FaultInjection(**faults))
    with serving(server) as server:
        yield server

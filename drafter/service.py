"""The Drafter gRPC service and the drafter's role on the worker server."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

from drafter.config import SUFFIX_FIELDS, BatchingConfig, DrafterConfig
from drafter.engine import DraftEngine
from drafter.ngram import NgramEngine, describe_loaded, describe_target
from drafter.proposer import Proposer
from drafter.suffix import SuffixEngine
from specmesh.ops import metrics
from specmesh.runtime.models import LoadedModel
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
from specmesh.wire.convert import dists_to_wire
from specmesh.wire.validation import check_context, sampling_from_wire
from specmesh.worker.config import FaultInjection, ModelConfig, ServerConfig, split_options
from specmesh.worker.role import ModelDescription
from specmesh.worker.server import WorkerServer, WorkerServicerBase, rpc, serving

SERVICE_NAME = "specmesh.v1.Drafter"


class DrafterServicer(WorkerServicerBase, pb_grpc.DrafterServicer):
    @rpc
    def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        proposer: Proposer = self.engine
        config = self.worker.config
        session_key = self.session_key(request.session_id, context)
        if not 1 <= request.num_tokens <= config.max_draft_tokens:
            raise ValueError(f"num_tokens must be in 1..{config.max_draft_tokens}, got {request.num_tokens}")
        new_tokens = list(request.context.new_tokens)
        check_context(request.context.base_length, new_tokens, proposer.description.vocab_size,
                      self.worker.max_context_length - request.num_tokens)
        params = sampling_from_wire(request.sampling.temperature, request.sampling.top_k, request.sampling.top_p)
        self.before_work(context)
        proposal = proposer.propose(session_key, request.context.base_length, request.context.base_hash,
                                    new_tokens, request.num_tokens, params, request.seed, is_active=context.is_active)
        metrics.DRAFT_TOKENS_PROPOSED.inc(len(proposal.tokens))
        return pb.ProposeResponse(
            tokens=list(proposal.tokens),
            distributions=dists_to_wire(proposal.dists),
            committed_length=proposal.committed_length)


def model_proposer(config: DrafterConfig, server: ServerConfig, preloaded: LoadedModel | None) -> Proposer:
    """The draft model config.model, on a KV cache per session, with concurrent sessions' draft steps batched."""
    # exact=False: drafts are verified, so the drafter may take the fastest passes whatever their rounding.
    return DraftEngine(config.model.load(server, preloaded, exact=False), server.limits, config.batching)


def weightless_description(config: DrafterConfig, preloaded: LoadedModel | None) -> ModelDescription:
    """A drafter without weights (ngram, suffix): config.model only names the tokenizer (the target's), and a preloaded
    model only lends its tokenizer and vocabulary width."""
    if preloaded is None:
        return describe_target(config.model.model, config.vocab_size)
    description = describe_loaded(preloaded)
    if config.vocab_size is not None:
        description = dataclasses.replace(description, vocab_size=config.vocab_size)
    return description


def ngram_proposer(config: DrafterConfig, server: ServerConfig, preloaded: LoadedModel | None) -> Proposer:
    """Prompt lookup: no weights loaded."""
    return NgramEngine(weightless_description(config, preloaded), server.limits, config.ngram_config())


def suffix_proposer(config: DrafterConfig, server: ServerConfig, preloaded: LoadedModel | None) -> Proposer:
    """SuffixDecoding: no weights loaded. A session's tree undoes the drafts of two rounds without a rebuild."""
    return SuffixEngine(weightless_description(config, preloaded), server.limits, config.suffix_config(),
                        undo_tokens=max(64, 2 * (server.max_draft_tokens + 1)))


# One per drafting method (drafter/config.py METHODS).
PROPOSERS: dict[str, Callable[[DrafterConfig, ServerConfig, LoadedModel | None], Proposer]] = {
    "model": model_proposer, "ngram": ngram_proposer, "suffix": suffix_proposer}


class DrafterRole:
    """The drafter on the worker server (a WorkerRole, specmesh/worker/role.py)."""

    name = "drafter"
    service_name = SERVICE_NAME

    def __init__(self, config: DrafterConfig, preloaded: LoadedModel | None = None) -> None:
        self.config = config
        self._preloaded = preloaded  # tests and embedding: a model already in memory instead of config.model

    def add_servicer(self, worker: WorkerServer, server: grpc.Server) -> None:
        pb_grpc.add_DrafterServicer_to_server(DrafterServicer(worker), server)

    def build_engine(self, config: ServerConfig) -> Proposer:
        return PROPOSERS[self.config.method](self.config, config, self._preloaded)

    def info_fields(self, engine: Proposer) -> dict[str, float]:
        return {"draft_per_token_s": engine.draft_per_token_s}


@contextmanager
def run_server(model: str | LoadedModel, port: int = 0, method: str = "model", vocab_size: int | None = None,
               ngram_min: int | None = None, ngram_max: int | None = None, **options) -> Iterator[WorkerServer]:
    """A started, warmed-up drafter on `port` (0 = ephemeral); stopped on exit. For tests and embedding. `options`:
    fields of ServerConfig, ModelConfig (but `model`) and FaultInjection, and DrafterConfig's suffix_* fields.

    With method="ngram" or "suffix", `model` names (or is) the target whose tokenizer the drafter uses; no weights
    are loaded."""
    preloaded = model if isinstance(model, LoadedModel) else None
    suffix = {name: options.pop(name) for name in SUFFIX_FIELDS if name in options}
    server_options, model_options, batching, faults = split_options(options, ServerConfig, ModelConfig,
                                                                    BatchingConfig, FaultInjection)
    config = DrafterConfig(ModelConfig(preloaded.name if preloaded else model, **model_options), method=method,
                           vocab_size=vocab_size, ngram_min=ngram_min, ngram_max=ngram_max, **suffix,
                           batching=BatchingConfig(**batching))
    server = WorkerServer(DrafterRole(config, preloaded), ServerConfig(port=port, **server_options),
                          FaultInjection(**faults))
    with serving(server) as server:
        yield server

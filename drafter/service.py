"""The Drafter gRPC service."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from drafter.engine import DraftEngine
from drafter.ngram import (DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, NgramConfig, NgramEngine, NgramModelInfo,
                           NgramWorkerServer)
from specmesh.ops import metrics
from specmesh.runtime.models import LoadedModel
from specmesh.worker.server import WorkerConfig, WorkerServer, WorkerServicerBase, rpc, serving
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
from specmesh.wire.convert import dists_to_wire
from specmesh.wire.validation import check_context, sampling_from_wire

SERVICE_NAME = "specmesh.v1.Drafter"


class DrafterServicer(WorkerServicerBase, pb_grpc.DrafterServicer):
    @rpc
    def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        engine: DraftEngine | NgramEngine = self.engine
        config = self.worker.config
        session_key = self.session_key(request.session_id, context)
        if not 1 <= request.num_tokens <= config.max_draft_tokens:
            raise ValueError(f"num_tokens must be in 1..{config.max_draft_tokens}, got {request.num_tokens}")
        new_tokens = list(request.context.new_tokens)
        check_context(request.context.base_length, new_tokens, engine.loaded.vocab_size,
                      self.worker.max_context_length - request.num_tokens)
        params = sampling_from_wire(request.sampling.temperature, request.sampling.top_k, request.sampling.top_p)
        self.before_work(context)
        proposal = engine.propose(session_key, request.context.base_length, request.context.base_hash,
                                  new_tokens, request.num_tokens, params, request.seed, is_active=context.is_active)
        metrics.DRAFT_TOKENS_PROPOSED.inc(len(proposal.tokens))
        return pb.ProposeResponse(
            tokens=list(proposal.tokens),
            distributions=dists_to_wire(proposal.dists),
            committed_length=proposal.committed_length)


METHODS = ("model", "ngram")


def build_server(config: WorkerConfig, preloaded: LoadedModel | NgramModelInfo | None = None, *,
                 method: str = "model", vocab_size: int | None = None, ngram_min: int | None = None,
                 ngram_max: int | None = None) -> WorkerServer:
    """A drafter server. method "model": a draft model (config.model) on a KV cache; method "ngram": prompt lookup,
    no weights loaded, config.model only names the tokenizer (use the target's), vocab_size overrides the logits width
    reported to the coordinator, ngram_min/ngram_max bound the matched n-gram length."""
    if method == "model":
        given = [name for name, value in (("vocab_size", vocab_size), ("ngram_min", ngram_min),
                                          ("ngram_max", ngram_max)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to the ngram method (--method ngram)")
        if isinstance(preloaded, NgramModelInfo):
            raise ValueError("the model method needs a loaded model, not an NgramModelInfo")
        return WorkerServer(config, lambda loaded, server: DraftEngine(loaded, server.config.limits), DrafterServicer,
                            pb_grpc.add_DrafterServicer_to_server, SERVICE_NAME, preloaded)
    if method == "ngram":
        ngram = NgramConfig(min_ngram=ngram_min if ngram_min is not None else DEFAULT_MIN_NGRAM,
                            max_ngram=ngram_max if ngram_max is not None else DEFAULT_MAX_NGRAM)
        return NgramWorkerServer(config, lambda info, server: NgramEngine(info, server.config.limits, ngram),
                                 DrafterServicer, pb_grpc.add_DrafterServicer_to_server, SERVICE_NAME, preloaded,
                                 vocab_size=vocab_size)
    raise ValueError(f"unknown drafting method {method!r}; expected one of {', '.join(METHODS)}")


@contextmanager
def run_server(model: str | LoadedModel | NgramModelInfo, port: int = 0, method: str = "model",
               vocab_size: int | None = None, ngram_min: int | None = None, ngram_max: int | None = None,
               **options) -> Iterator[WorkerServer]:
    """A started, warmed-up drafter on `port` (0 = ephemeral); stopped on exit. For tests and embedding.

    With method="ngram", `model` names (or is) the target whose tokenizer the drafter uses; no weights are loaded."""
    preloaded = model if isinstance(model, (LoadedModel, NgramModelInfo)) else None
    config = WorkerConfig(model=preloaded.name if preloaded else model, role="drafter", port=port, **options)
    server = build_server(config, preloaded, method=method, vocab_size=vocab_size, ngram_min=ngram_min,
                          ngram_max=ngram_max)
    with serving(server) as server:
        yield server

"""Drafters behind the Proposer protocol: the service serves any Proposer, and the draft model and prompt lookup
are interchangeable siblings."""

from __future__ import annotations

import grpc
import pytest

from coordinator.fleet.polling import wait_until
from drafter.config import METHODS, DrafterConfig
from drafter.engine import DraftEngine
from drafter.ngram import NgramEngine, describe_loaded
from drafter.proposer import Proposal
from drafter.service import PROPOSERS, SERVICE_NAME, DrafterServicer
from specmesh.decoding.sampling import SamplingParams, SparseDist
from specmesh.runtime.engine import as_engine
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
from specmesh.wire.history import EMPTY_HASH, TokenHistory
from specmesh.worker.config import ModelConfig, ServerConfig
from specmesh.worker.role import ModelDescription
from specmesh.worker.server import WorkerServer, serving
from specmesh.worker.session_store import SessionLimits, SessionStore

GREEDY = SamplingParams()
DESCRIPTION = ModelDescription("fake-drafter", 50, "f" * 64, (0,), "cpu", "none", context_limit=None)


class CountingProposer:
    """Proposes k, k+1, ... whatever the history; remembers what it was asked."""

    draft_per_token_s = 0.125

    def __init__(self) -> None:
        self.description = DESCRIPTION
        self.sessions = SessionStore(SessionLimits(), lambda: _Session())
        self.calls: list[tuple] = []

    def propose(self, session_id, base_length, base_hash, new_tokens, k, params, seed, is_active=lambda: True):
        session = self.sessions.synced(session_id, base_length, base_hash, new_tokens)
        self.calls.append((session_id, list(session.history.tokens), k, params, seed))
        tokens = tuple(range(k, 2 * k))
        dists = () if params.is_greedy else tuple(SparseDist((t,), (1.0,)) for t in tokens)
        return Proposal(tokens, dists, len(session.history))

    def end_session(self, session_id: str) -> bool:
        return self.sessions.end(session_id)

    def warm_up(self) -> None:
        pass


class _Session:
    def __init__(self) -> None:
        self.history, self.num_bytes = TokenHistory(), 0


class FakeDrafterRole:
    name = "drafter"
    service_name = SERVICE_NAME

    def __init__(self) -> None:
        self.proposer = CountingProposer()

    def add_servicer(self, worker, server) -> None:
        pb_grpc.add_DrafterServicer_to_server(DrafterServicer(worker), server)

    def build_engine(self, config: ServerConfig) -> CountingProposer:
        return self.proposer

    def info_fields(self, engine: CountingProposer) -> dict[str, float]:
        return {"draft_per_token_s": engine.draft_per_token_s}


def test_the_service_serves_any_proposer():
    role = FakeDrafterRole()
    with serving(WorkerServer(role, ServerConfig(max_draft_tokens=6))) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.DrafterStub(channel)
        reply = stub.Propose(pb.ProposeRequest(session_id="s", num_tokens=3, seed=4, context=pb.ContextSync(
            base_length=0, base_hash=EMPTY_HASH, new_tokens=[1, 2])), timeout=5)
        assert (list(reply.tokens), reply.committed_length, len(reply.distributions)) == ([3, 4, 5], 2, 0)
        sampled = stub.Propose(pb.ProposeRequest(session_id="t", num_tokens=2, context=pb.ContextSync(
            base_length=0, base_hash=EMPTY_HASH, new_tokens=[1]), sampling=pb.SamplingParams(temperature=0.5)),
            timeout=5)
        assert [list(d.token_ids) for d in sampled.distributions] == [[2], [3]]
        for tokens, k in (([1, DESCRIPTION.vocab_size], 2), ([1], 7)):  # the description's vocabulary, the limit
            with pytest.raises(grpc.RpcError) as error:
                stub.Propose(pb.ProposeRequest(session_id="u", num_tokens=k, context=pb.ContextSync(
                    base_length=0, base_hash=EMPTY_HASH, new_tokens=tokens)), timeout=5)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = stub.Info(pb.InfoRequest(), timeout=5)
        assert (info.model_name, info.draft_per_token_s, info.role) == ("fake-drafter", 0.125, "drafter")
        assert stub.EndSession(pb.EndSessionRequest(session_id="s"), timeout=5).existed
    assert [(c[1], c[2], c[4]) for c in role.proposer.calls] == [([1, 2], 3, 4), ([1], 2, 0)]


def test_every_drafting_method_has_a_proposer():
    assert set(PROPOSERS) == set(METHODS)


@pytest.mark.parametrize("options, message", [
    (dict(method="beam"), "unknown drafting method"),
    (dict(vocab_size=100), "only apply to the ngram method"),
    (dict(ngram_min=2, ngram_max=3), "ngram_min, ngram_max only apply"),
    (dict(method="ngram", ngram_min=3, ngram_max=2), "min_ngram"),
    (dict(method="ngram", vocab_size=0), "vocab_size"),
])
def test_drafter_config_refuses_what_cannot_work(options, message):
    with pytest.raises(ValueError, match=message):
        DrafterConfig(ModelConfig("tiny-random-qwen2"), **options)


def test_ngram_bounds_default_when_not_given():
    config = DrafterConfig(ModelConfig("tiny-random-qwen2"), method="ngram", ngram_max=5).ngram_config()
    assert (config.min_ngram, config.max_ngram) == (1, 5)


@pytest.fixture(scope="module")
def proposers(tiny_target):
    return {"model": DraftEngine(tiny_target), "ngram": NgramEngine(describe_loaded(tiny_target))}


@pytest.mark.parametrize("method", ["model", "ngram"])
def test_model_and_ngram_proposers_are_siblings(proposers, tiny_target, method):
    proposer = proposers[method]
    model = ModelDescription.of(as_engine(tiny_target))
    # Both describe the same vocabulary for the same tokenizer; only the model drafter runs a model.
    assert (proposer.description.vocab_size, proposer.description.fingerprint) == (model.vocab_size, model.fingerprint)
    assert proposer.description.engine == ("transformers" if method == "model" else "")
    proposer.warm_up()
    # The draft model's cost is measured in the background after warm-up (not cached for a tiny test model).
    assert wait_until(lambda: proposer.draft_per_token_s > 0, timeout_s=30 if method == "model" else 0.3) == (
        method == "model")
    prompt = [5, 6, 7, 5, 6]
    first = proposer.propose("s", 0, EMPTY_HASH, prompt, 2, GREEDY, 0)
    assert first.committed_length == len(prompt) and len(first.tokens) <= 2
    # The next call syncs what was accepted: the first draft token plus another.
    committed = [*prompt, *first.tokens[:1], 9]
    second = proposer.propose("s", len(prompt), TokenHistory(prompt).hash_at(len(prompt)), committed[len(prompt):],
                              3, GREEDY, 0)
    assert second.committed_length == len(committed)
    assert proposer.end_session("s") and not proposer.end_session("s")
    assert len(proposer.sessions) == 0

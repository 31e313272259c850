"""The SuffixDecoding drafter (drafter/suffix.py): its engine on crafted histories (repeated JSON tool calls, an edited
code block returned again), the global tree shared by sessions, exact sampling with its point-mass drafts, the CLI,
and a real drafter subprocess (`drafter serve --method suffix`) with a verifier on the tiny float64 target, whose
output must equal the target's own greedy decoding."""

from __future__ import annotations

import logging

import pytest
import torch

import specmesh.worker.config
from coordinator import Coordinator, GenerationOptions
from coordinator.fleet.worker_client import RemoteWorker
from drafter.cli import main as drafter_main
from drafter.config import DrafterConfig
from drafter.ngram import ngram_description
from drafter.service import run_server as run_drafter
from drafter.suffix import SuffixConfig, SuffixEngine, better
from drafter.suffix_tree import Candidate, brute_force_counts
from specmesh.decoding.acceptance import sampled_verdict
from specmesh.decoding.sampling import SamplingParams, SparseDist, warp_probs
from specmesh.wire.contract import Cancelled
from specmesh.wire.history import EMPTY_HASH, ResyncRequired, history_hash
from specmesh.worker.config import ModelConfig
from specmesh.worker.session_store import SessionLimits
from tests.chaos.conftest import running_fleet
from tests.helpers import reference_greedy
from tests.specmesh.decoding.test_acceptance import P_LOGITS, T1, assert_distributed_as

GREEDY = SamplingParams()
DESCRIPTION = ngram_description("words", 1000, (), "test", None)  # a weightless drafter's Info: only the width counts

_WORDS: dict[str, int] = {}


def ids(text: str) -> list[int]:
    """Token ids of a whitespace-separated text, one per word (a stable toy vocabulary)."""
    return [_WORDS.setdefault(word, len(_WORDS) + 10) for word in text.split()]


class Client:
    """A coordinator's drafter session: syncs the committed history (new tokens since the last call), optionally with
    drafts past it (pipelining), and commits what the "target" produced."""

    def __init__(self, engine: SuffixEngine, session_id: str, prompt: list[int], params=GREEDY) -> None:
        self.engine, self.session_id, self.params = engine, session_id, params
        self.history, self.held = list(prompt), 0

    def propose(self, k: int = 16, after: list[int] = ()) -> tuple[int, ...]:
        base = self.held
        proposal = self.engine.propose(self.session_id, base, history_hash(self.history[:base]),
                                       [*self.history[base:], *after], k, self.params, 0)
        assert proposal.committed_length == len(self.history) + len(after)
        self.held = len(self.history)
        return proposal.tokens

    def generate(self, truth: list[int], k: int = 16) -> list[tuple[int, int]]:
        """Greedy speculative decoding of `truth` (what the target would say): each round drafts, keeps the drafts
        that agree with the truth and commits the next true token. Returns (drafted, accepted) per round."""
        rounds, done = [], 0
        while done < len(truth):
            draft = self.propose(min(k, len(truth) - done))
            accepted = 0
            while accepted < len(draft) and draft[accepted] == truth[done + accepted]:
                accepted += 1
            step = truth[done:done + accepted + 1]
            self.history += step
            done += len(step)
            rounds.append((len(draft), accepted))
        return rounds

    def end(self) -> bool:
        return self.engine.end_session(self.session_id)


def tree_of(engine: SuffixEngine, session_id: str, history: list[int]):
    """The session's tree (through a sync that adds nothing)."""
    return engine.sessions.synced(session_id, len(history), history_hash(history), []).tree


# ---- the engine ----

def test_engine_greedy_and_sampled_proposals():
    engine = SuffixEngine(DESCRIPTION)
    prompt = [10, 11, 12, 13, 10, 11]
    greedy = engine.propose("a", 0, EMPTY_HASH, prompt, 3, GREEDY, 0)
    assert greedy.tokens == (12, 13) and greedy.dists == () and greedy.committed_length == 6  # 2-token match: 2
    sampled = engine.propose("b", 0, EMPTY_HASH, prompt, 2, SamplingParams(temperature=0.8, top_p=0.9), 5)
    assert sampled.tokens == (12, 13)
    assert sampled.dists == (SparseDist((12,), (1.0,)), SparseDist((13,), (1.0,)))  # a point mass per token
    assert engine.propose("c", 0, EMPTY_HASH, [1, 2, 3], 4, GREEDY, 0).tokens == ()  # no match: empty proposal
    assert engine.propose("d", 0, EMPTY_HASH, [*range(20, 40), *range(20, 30)], 4, GREEDY, 0).tokens == (
        30, 31, 32, 33)  # a 10-token match, at most k tokens
    assert len(engine.sessions) == 4
    assert engine.end_session("a") and not engine.end_session("a")
    assert len(engine.sessions) == 3


def test_session_tree_follows_syncs_drafts_past_the_history_and_retries():
    engine = SuffixEngine(DESCRIPTION, config=SuffixConfig(max_depth=8))
    engine.propose("s", 0, EMPTY_HASH, [1, 2, 3], 2, GREEDY, 0)
    history = [1, 2, 3, 4, 1, 2]
    assert engine.propose("s", 3, history_hash([1, 2, 3]), [4, 1, 2], 2, GREEDY, 0).tokens == (3, 4)
    # Pipelining: drafting past two uncommitted tokens; the next sync from the committed length cuts them off.
    assert engine.propose("s", 6, history_hash(history), [3, 4], 2, GREEDY, 0).tokens == (1, 2)
    assert engine.propose("s", 6, history_hash(history), [3, 9], 2, GREEDY, 0).tokens == ()
    history += [3, 9]
    assert tree_of(engine, "s", history).counts() == brute_force_counts([history], 8)
    # A retry building on a shorter prefix with other tokens.
    assert engine.propose("s", 2, history_hash([1, 2]), [5, 1, 2], 2, GREEDY, 0).tokens == (5, 1)
    assert tree_of(engine, "s", [1, 2, 5, 1, 2]).counts() == brute_force_counts([[1, 2, 5, 1, 2]], 8)
    with pytest.raises(ResyncRequired):
        engine.propose("s", 6, history_hash(history), [7], 2, GREEDY, 0)  # the server holds another history
    with pytest.raises(ResyncRequired):
        engine.propose("unknown", 3, history_hash([1, 2, 3]), [1], 2, GREEDY, 0)
    with pytest.raises(Cancelled):
        engine.propose("s", 0, EMPTY_HASH, [1], 2, GREEDY, 0, is_active=lambda: False)


TOOL_CALL = '<call> { "name" : "search" , "arguments" : { "query" : " QUERY " , "limit" : 5 } } </call>'


def tool_call(query: str) -> list[int]:
    return ids(TOOL_CALL.replace("QUERY", query))


def test_repeated_json_tool_calls_are_drafted():
    engine = SuffixEngine(DESCRIPTION)
    prompt = ids("system : answer with tool calls . user : look up cats , dogs and owls .")
    earlier = [*tool_call("cats"), *ids("<result> cats are mammals </result>"),
               *tool_call("dogs"), *ids("<result> dogs bark </result>")]
    client = Client(engine, "agent", prompt)
    client.generate(earlier)
    third = client.generate(tool_call("owls"))  # the same template, another argument
    # 21 tokens in 7 rounds: the template is drafted, in drafts that grow with the match (1, 3, 7 tokens); the misses
    # are at the new argument and right after it.
    assert sum(accepted for _, accepted in third) >= 15 and len(third) <= 7, third
    # A new session (another request): the template comes from the global tree, fed by the first session's output.
    assert client.end()
    other = Client(engine, "other", ids("user : look up bats ."))
    rounds = other.generate(tool_call("bats"))
    assert sum(accepted for _, accepted in rounds) >= 14 and len(rounds) <= 8, rounds


CODE_V1 = ("def area ( r ) : NL return 3.14 * r * r NL NL def perimeter ( r ) : NL return 2 * 3.14 * r NL NL "
           "def volume ( r ) : NL return 4 / 3 * 3.14 * r ** 3 NL")
CODE_V2 = CODE_V1.replace("return 3.14 * r * r", "return math.pi * r ** 2")


def test_an_edited_code_block_returned_again():
    engine = SuffixEngine(DESCRIPTION)
    v1, v2 = ids(CODE_V1), ids(CODE_V2)
    client = Client(engine, "coder", [*ids("user : use math.pi in area : ```"), *v1, *ids("``` assistant :")])
    # Returned with an edit: copied from the prompt up to the edited line, a miss there, and copied again after it.
    client.generate(ids("here : ```"))
    first = client.generate(v2)
    missed = sum(1 for drafted, accepted in first if accepted < drafted)
    assert missed <= 5 and sum(accepted for _, accepted in first) >= len(v2) - 12, first
    assert all(accepted == drafted for drafted, accepted in first[-3:]), first  # the unchanged lines after the edit
    assert sum(accepted for _, accepted in first[-3:]) >= 25, first
    # Returned again (a later turn): the most recent version is drafted, the edit included.
    client.generate(ids("``` user : once more : ```"))
    again = client.generate(v2)
    assert all(accepted == drafted for drafted, accepted in again[1:]), again
    assert len(again) <= 8, again


def test_global_tree_is_shared_by_sessions_and_bounded():
    engine = SuffixEngine(DESCRIPTION, config=SuffixConfig(max_tokens=60, max_requests=2))
    output = ids("the answer is forty two because six times seven is forty two")
    first = Client(engine, "first", ids("user : what is the answer ?"))
    first.generate(output)
    assert engine.global_tree.num_tokens == 0  # nothing until the session ends
    assert first.end()
    (recorded,) = engine.global_tree.sequences  # the output, but the last round's tokens (never synced)
    assert 0 < len(recorded) < len(output) and list(recorded) == output[:len(recorded)]
    second = Client(engine, "second", ids("user : and why ?"))
    assert second.propose() == ()  # the prompt alone matches nothing
    second.history += output[:3]  # "the answer is": drafted from the first session's output
    assert second.propose() == tuple(output[3:6])
    for i in range(4):  # later requests push the oldest out: at most 2 requests, 60 tokens
        Client(engine, f"more-{i}", [1, 2]).generate(ids(f"filler {i} " * 9))
        engine.end_session(f"more-{i}")
    assert len(engine.global_tree.sequences) == 2 and engine.global_tree.num_tokens <= 60
    assert Client(engine, "third", output[:3]).propose() == ()  # forgotten


def test_prompts_are_indexed_on_request():
    prompt, output = ids("summarize : alpha beta gamma delta"), ids("alpha and beta then gamma")
    for index_prompts, expected in ((False, ()), (True, tuple(output[:4]))):
        engine = SuffixEngine(DESCRIPTION, config=SuffixConfig(index_prompts=index_prompts))
        Client(engine, "first", prompt).generate(output + [0])
        engine.end_session("first")
        # The same request again: with its prompt indexed, drafted from the very first token.
        assert Client(engine, "again", prompt).propose(4) == expected


def test_sessions_dropped_by_the_store_are_recorded_and_the_warm_up_is_not():
    clock = [0.0]
    engine = SuffixEngine(DESCRIPTION, SessionLimits(max_sessions=2, idle_ttl_s=10))
    store = engine.sessions
    store._sessions = type(store._sessions)(2, 10, store._on_remove, timer=lambda: clock[0])  # a clock of our own
    engine.warm_up()
    assert engine.global_tree.num_tokens == 0 and len(store) == 0
    Client(engine, "a", [1, 2]).generate([3, 4, 5, 6])
    Client(engine, "b", [1, 2]).generate([7, 8, 9])
    Client(engine, "c", [1, 2]).propose()  # full: "a", the least recently used, is evicted ...
    Client(engine, "d", [1, 2]).propose()  # ... and recorded by the next call (which evicts "b")
    assert [list(s) for s in engine.global_tree.sequences] == [[3, 4, 5]]  # the last round's token was not synced
    clock[0] = 11.0
    assert len(store) == 0  # "c" and "d" idle past the TTL (no output of their own)
    Client(engine, "e", [1, 2]).propose()
    assert [list(s) for s in engine.global_tree.sequences] == [[3, 4, 5], [7, 8]]


def test_the_longer_match_wins_then_the_higher_score():
    short, long_ = Candidate(2, (1, 2), (1.0, 1.0), 2.0), Candidate(3, (5,), (0.5,), 0.5)
    assert better(short, long_) is long_ and better(long_, short) is long_
    assert better(Candidate(3, (1,), (0.2,), 0.2), long_) is long_
    assert better(Candidate(5, (), (), 0.0), short) is short  # a match without a draft is no candidate
    assert better(short, Candidate(2, (3, 4), (1.0, 1.0), 2.0)) is short  # ties: the first (the session's)


# ---- exact sampling: a point mass q ----

@pytest.mark.parametrize("history, draft", [
    ([1, 2, 6, 3, 1, 2], 6),  # a draft the target finds unlikely (p ~ 0.0075): mostly rejected and resampled
    ([1, 2, 0, 3, 1, 2], 0),  # a likely one
])
def test_point_mass_drafts_keep_sampling_exact(history, draft):
    engine = SuffixEngine(ngram_description("eight", 8, (), "test", None))
    proposal = engine.propose("s", 0, EMPTY_HASH, history, 1, T1, 0)
    assert proposal.tokens == (draft,) and proposal.dists == (SparseDist((draft,), (1.0,)),)
    rows = torch.stack([P_LOGITS, P_LOGITS])  # the target's logits for the draft and the bonus position
    counts = torch.zeros(P_LOGITS.numel(), dtype=torch.float64)
    for seed in range(2_000):
        verdict = sampled_verdict(list(proposal.tokens), list(proposal.dists), rows, T1, seed, len(history))
        counts[draft if verdict.accepted else verdict.next_token] += 1
    assert_distributed_as(counts, warp_probs(P_LOGITS, T1))


# ---- configuration and the CLI ----

def test_config_maps_the_suffix_flags():
    config = DrafterConfig(ModelConfig("tiny-random-qwen2"), method="suffix", suffix_max_depth=32,
                           suffix_max_tokens=500, suffix_max_requests=7, suffix_spec_factor=2.0,
                           suffix_min_prob=0.2, suffix_index_prompts=True)
    assert config.suffix_config() == SuffixConfig(max_depth=32, max_tokens=500, max_requests=7, spec_factor=2.0,
                                                  min_prob=0.2, index_prompts=True)
    assert DrafterConfig(ModelConfig("x"), method="suffix").suffix_config() == SuffixConfig()
    assert DrafterConfig(ModelConfig("x"), method="suffix", vocab_size=300).vocab_size == 300


@pytest.mark.parametrize("args, message", [
    (["--suffix-max-depth", "8"], "only apply to the suffix method"),
    (["--method", "ngram", "--suffix-index-prompts"], "only apply to the suffix method"),
    (["--method", "suffix", "--ngram-max", "4"], "only apply to the ngram method"),
    (["--method", "suffix", "--suffix-max-depth", "1"], "--suffix-max-depth"),
    (["--method", "suffix", "--suffix-max-tokens", "0"], "--suffix-max-tokens"),
    (["--method", "suffix", "--suffix-min-prob", "2"], "--suffix-min-prob"),
    (["--method", "suffix", "--suffix-spec-factor", "0"], "--suffix-spec-factor"),
])
def test_cli_refuses_bad_suffix_options(args, message, capsys):
    handlers = logging.root.handlers[:]  # serve_main's logging.basicConfig would leave a handler on capsys' stream
    try:
        status = drafter_main(["serve", "--model", "tiny-random-qwen2", "--port", "0", *args])
    except SystemExit as e:  # argparse's own errors
        status = e.code
    finally:
        logging.root.handlers[:] = handlers
    assert status == 2
    assert message in capsys.readouterr().err


def _no_weights(*args, **kwargs):
    raise AssertionError("the suffix drafter must not load model weights")


def test_run_server_builds_a_weightless_suffix_drafter(tiny_target):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(specmesh.worker.config, "load_engine", _no_weights)
        with run_drafter("tiny-random-qwen2", port=0, method="suffix", suffix_max_depth=16,
                         suffix_index_prompts=True) as server:
            engine = server.engine
            assert isinstance(engine, SuffixEngine)
            assert engine.config == SuffixConfig(max_depth=16, index_prompts=True)
            assert engine.description.vocab_size == tiny_target.vocab_size
            assert engine.global_tree.num_tokens == 0 and len(engine.sessions) == 0  # the warm-up left nothing


# ---- a real `drafter serve --method suffix` subprocess and a verifier ----

MAX_NEW = 40


@pytest.fixture(scope="module")
def workers():
    """A verifier and a suffix drafter, as subprocesses, on the tiny float64 target (tests/chaos/conftest.py)."""
    with running_fleet() as fleet:
        verifier = fleet.start("verifier")
        drafter = fleet.start("drafter", model="tiny-random-qwen2",
                              extra=("--method", "suffix", "--suffix-max-depth", "48", "--suffix-max-tokens", "20000",
                                     "--suffix-max-requests", "50"))
        yield verifier.address, drafter.address


def generate(workers, tokenizer, prompt, **options):
    verifier, drafter = workers
    # The heuristic keeps drafting (the cost policy may find drafting not worth it on a busy machine).
    with Coordinator(verifier=verifier, drafter=drafter, tokenizer=tokenizer) as c:
        return c.generate(list(prompt), GenerationOptions(max_new_tokens=MAX_NEW, draft_policy="heuristic",
                                                          **options))


def test_suffix_drafter_gives_target_only_output_and_drafts_a_repeated_request(workers, tiny_target):
    prompt = tiny_target.tokenizer("The quick brown fox")["input_ids"]
    expected = reference_greedy(tiny_target.model, prompt, MAX_NEW, set(tiny_target.eos_token_ids))
    first = generate(workers, tiny_target.tokenizer, prompt)
    again = generate(workers, tiny_target.tokenizer, prompt)
    assert first.token_ids == expected and again.token_ids == expected
    # The first time, the random model's output barely repeats itself; the second time the drafter knows it from the
    # global tree (the first request's output, recorded when its session ended).
    assert again.stats["acceptance_rate"] >= 0.9, again.stats
    assert again.stats["rounds"] <= len(expected) // 2, (first.stats, again.stats)  # target-only: one per token


def test_suffix_drafter_sampling_is_valid(workers, tiny_target):
    # Unlike the n-gram drafter's, a seeded run need not repeat itself token for token: the global tree learns from
    # every request, so the next run gets other drafts, and which sample a seed draws depends on the drafts (the
    # distribution does not: test_point_mass_drafts_keep_sampling_exact).
    prompt = tiny_target.tokenizer("a" * 20)["input_ids"]  # the tiny target repeats itself on it: drafts happen
    for seed in (3, 4):
        result = generate(workers, tiny_target.tokenizer, prompt, temperature=0.7, seed=seed)
        assert len(result.token_ids) == MAX_NEW or result.token_ids[-1] in tiny_target.eos_token_ids
        assert result.stats["drafted_tokens"] > 0  # point-mass distributions passed the verifier's validation
        assert result.stats["degraded_rounds"] == 0


def test_suffix_drafter_info(workers, tiny_target):
    worker = RemoteWorker(workers[1], "drafter")
    try:
        info = worker.info()
    finally:
        worker.close()
    assert (info.model_name, info.vocab_size, info.tokenizer_fingerprint, info.dtype, info.role) == (
        "tiny-random-qwen2", tiny_target.vocab_size, tiny_target.fingerprint, "none", "drafter")

"""Drafting across tokenizers (coordinator/translation.py), without gRPC: two small byte-level BPE tokenizers whose
merges differ (so tokens merge across round boundaries differently on each side), a scripted target and fake drafter
sessions."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from coordinator.loop import Draft, DraftLength, LoopConfig, speculative_decode
from coordinator.translation import TextCodec, TokenTranslator, TranslatingDraftSource, deterministic_proposal
from specmesh.decoding.acceptance import Verdict

BYTES = pre_tokenizers.ByteLevel.alphabet()  # GPT-2's 256 printable stand-ins for the bytes


def bpe(words: list[str], reverse: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with one left-to-right chain of merges per word (" hello": " h", " he", ...);
    `reverse` numbers the byte tokens the other way round, so the two tokenizers' ids differ everywhere."""
    alphabet = sorted(BYTES, reverse=reverse)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = []
    encode_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for word in words:
        pieces = [piece for piece, _ in encode_bytes.pre_tokenize_str(word)][0]
        for i in range(1, len(pieces)):
            merged = pieces[:i + 1]
            if merged not in vocab:
                merges.append((pieces[:i], pieces[i]))
                vocab[merged] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


TARGET = bpe([" hello", " world", " the", " quick", " brown", "def", "ab"])
DRAFTER = bpe([" hel", " wor", " th", " qu", " bro", "lo", "ld", "ick", "wn", "def", "ab"], reverse=True)
TEXT = "def f():\n    say hello world, the quick brown fox: héllo 世界 🎉 ab\n"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def translator() -> TokenTranslator:
    return TokenTranslator(TARGET, DRAFTER, window=4)


def test_tokenizers_differ_and_round_trip():
    assert encode(TARGET, " hello") != encode(DRAFTER, " hello")
    assert len(encode(TARGET, " hello")) == 1 and len(encode(DRAFTER, " hello")) == 2
    for tokenizer in (TARGET, DRAFTER):
        assert tokenizer.decode(encode(tokenizer, TEXT)) == TEXT


def test_text_between_uses_context_and_holds_back_a_split_character():
    codec = TextCodec(TARGET, window=2)
    ids = encode(TARGET, "ab é")  # "ab", " ", then "é" as two byte tokens (no merge for it)
    assert len(ids) == 4
    assert codec.text_between(ids, 0, 4) == ("ab é", True)
    assert codec.text_between(ids, 1, 4) == (" é", True)
    assert codec.text_between(ids, 1, 3) == (" ", False)  # the first byte of "é" alone is not text yet
    assert codec.text_between(ids, 3, 4) == ("é", True)  # starts mid-character: the completed character


def test_draft_merges_with_the_window_as_the_target_tokenizes(translator):
    context = encode(TARGET, "say")
    # The drafted text after a whole word: re-encoded with the window, " hello" is the target's one token.
    assert translator.target_draft(context, " hello world") == encode(TARGET, " hello world")
    # Committed text ending mid-word: the committed tokens stay, and the text goes on from there.
    context = encode(TARGET, "say hel")
    assert TARGET.decode(context[-1:]) == " hel"
    draft = translator.target_draft(context, "lo world")
    assert TARGET.decode(draft) == "lo world"
    assert draft == encode(TARGET, "lo world")


def test_draft_completing_a_split_character(translator):
    context = encode(TARGET, "say é")[:-1]  # the target committed the first byte of "é" only
    draft = translator.target_draft(context, "é ab")
    assert TARGET.decode(context + draft) == "say é ab"
    assert translator.target_draft(context, "") == []


class FakeDrafter:
    """A drafter session in drafter tokens: records what it was told; proposes drafter tokens of `script`'s text
    after its history (an oracle: it knows the target's text)."""

    def __init__(self, prompt: list[int], script: str = "", sampled: bool = False) -> None:
        self.history, self.script, self.sampled = list(prompt), script, sampled
        self.updates: list[list[int]] = []
        self.afters: list[list[int]] = []
        self.ended = False

    def propose(self, k: int, after=()) -> Draft:
        self.afters.append(list(after))
        seen = DRAFTER.decode([*self.history, *after])
        assert self.script.startswith(seen), (seen, self.script)
        tokens = tuple(encode(DRAFTER, self.script[len(seen):])[:k])
        return Draft(tokens, tuple(deterministic_proposal(t) for t in tokens) if self.sampled else ())

    def update(self, committed) -> None:
        self.updates.append(list(committed))
        self.history.extend(committed)

    def end(self) -> None:
        self.ended = True


def open_fake(script: str = "", sampled: bool = False):
    sessions: list[FakeDrafter] = []

    def open_session(prompt: list[int]) -> FakeDrafter:
        sessions.append(FakeDrafter(prompt, script, sampled))
        return sessions[-1]
    return sessions, open_session


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_drafter_history_is_the_committed_text_resynced_by_its_tail(translator, chunk):
    target_ids = encode(TARGET, TEXT)
    prompt, generated = target_ids[:6], target_ids[6:]
    sessions, open_session = open_fake()
    source = TranslatingDraftSource(translator, prompt, open_session)
    session = sessions[0]
    for i in range(0, len(generated), chunk):
        stable_before = list(source.stable_drafter)
        source.update(generated[i:i + chunk])
        committed_text = TARGET.decode(source.target_ids).rstrip("\ufffd")
        # The drafter's history is the committed text (whole characters) as the drafter tokenizes it.
        assert DRAFTER.decode(source.drafter_ids) == committed_text
        assert source.drafter_ids == encode(DRAFTER, committed_text)
        # The stable prefix only grows, and the session holds exactly it: a changed tail is all that is resent.
        assert source.stable_drafter[:len(stable_before)] == stable_before
        assert session.history == source.stable_drafter
        assert len(source.tail) <= translator.window + 2 * chunk + 8
    assert sum(map(len, session.updates)) > len(encode(DRAFTER, TEXT)) // 2  # most of the history became stable


def test_merges_across_the_boundary_rewrite_only_the_tail(translator):
    sessions, open_session = open_fake()
    source = TranslatingDraftSource(translator, encode(TARGET, "def f(): say"), open_session)
    source.update(encode(TARGET, " hel"))
    assert DRAFTER.decode(source.tail[-1:]) == " hel"
    stable = list(source.stable_drafter)
    source.update(encode(TARGET, "lo"))  # " hel" + "lo": the drafter re-cuts its tail (" hel", "lo" here)
    assert source.drafter_ids == encode(DRAFTER, "def f(): say hello")
    assert source.stable_drafter[:len(stable)] == stable


def test_propose_translates_and_sends_the_tail(translator):
    script = "def f(): say hello world, the quick brown fox"
    sessions, open_session = open_fake(script)
    source = TranslatingDraftSource(translator, encode(TARGET, "def f(): say"), open_session)
    draft = source.propose(3)  # the drafter's " hel", "lo", " wor"
    assert sessions[0].afters[-1] == source.tail
    assert draft.tokens == tuple(encode(TARGET, " hello wor"))  # the target's " hello", " wor"
    assert draft.dists == ()  # greedy
    assert len(source.propose(1).tokens) == 1  # never more than k target tokens


def test_pipelined_proposal_drafts_after_uncommitted_tokens(translator):
    script = "def f(): say hello world, the quick brown fox"
    sessions, open_session = open_fake(script)
    source = TranslatingDraftSource(translator, encode(TARGET, "def f(): say"), open_session)
    draft = source.propose(4, after=encode(TARGET, " hello world"))
    assert TARGET.decode(list(draft.tokens)) == ", the qu"  # the drafter's ",", " th", "e", " qu"
    # The drafter saw the uncommitted text as its own tokens, after its stable prefix; nothing was committed.
    assert DRAFTER.decode([*source.stable_drafter, *sessions[0].afters[-1]]) == "def f(): say hello world"
    assert DRAFTER.decode(source.drafter_ids) == "def f(): say"


def test_sampled_drafts_are_deterministic_proposals(translator):
    sessions, open_session = open_fake("def f(): say hello world", sampled=True)
    source = TranslatingDraftSource(translator, encode(TARGET, "def f(): say"), open_session)
    draft = source.propose(4)
    assert draft.tokens and len(draft.dists) == len(draft.tokens)
    for token, dist in zip(draft.tokens, draft.dists):
        assert dist.token_ids == (token,) and dist.prob_of(token) == 1.0


def test_an_empty_proposal_is_an_empty_draft(translator):
    sessions, open_session = open_fake("def f(): say")  # nothing left to propose
    source = TranslatingDraftSource(translator, encode(TARGET, "def f(): say"), open_session)
    assert source.propose(4) == Draft()
    source.end()
    assert sessions[0].ended


class ScriptedTarget:
    """A greedy target that always continues with `script` (target tokens)."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.position = script, 0

    def verify(self, draft: Draft) -> Verdict:
        expected = self.script[self.position:]
        accepted = 0
        while accepted < len(draft.tokens) and draft.tokens[accepted] == expected[accepted]:
            accepted += 1
        self.position += accepted + 1
        return Verdict(accepted, expected[accepted])


@pytest.mark.parametrize("pipeline", [False, True])
def test_an_oracle_drafter_of_another_tokenizer_is_mostly_accepted(translator, pipeline):
    """Through the loop: the output is the target's, and the translation keeps drafts the target would write."""
    prompt_text = "def f():\n    say"
    full = prompt_text + " hello world, the quick brown fox, the quick brown hello world ab ab"
    target_ids = encode(TARGET, full)
    prompt = encode(TARGET, prompt_text)
    assert target_ids[:len(prompt)] == prompt
    script = target_ids[len(prompt):]
    sessions, open_session = open_fake(full)
    source = TranslatingDraftSource(translator, prompt, open_session)
    config = LoopConfig(max_new_tokens=len(script), draft_length=DraftLength.fixed(4), pipeline=pipeline,
                        max_propose_tokens=8)
    result = speculative_decode(source, ScriptedTarget(script), config)
    assert result.tokens == script
    drafted = sum(r.drafted for r in result.rounds)
    accepted = sum(r.accepted for r in result.rounds)
    assert drafted and accepted / drafted > 0.7, (accepted, drafted)

"""Incremental detokenisation: the streamed text equals one decode of all tokens, at the cost of a short window."""

from __future__ import annotations

import random

import pytest

from coordinator.text_stream import TextStream

TEXT = "def f(x):\n    return x * 2  # naïve — 日本語 🙂 done.\n\nNext   line"


class CountingTokenizer:
    """Records the length of every decode call, to check that each round decodes a window, not the whole output."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("model_fixture", ["tiny_target", "tiny_other_tokenizer"])
def test_streamed_text_equals_full_decode(model_fixture, request):
    tokenizer = request.getfixturevalue(model_fixture).tokenizer
    rng = random.Random(5)
    for trial in range(200):
        # Real text, and random ids that split multi-byte characters across tokens and rounds.
        ids = tokenizer(TEXT * 4)["input_ids"] if trial % 2 == 0 else [rng.randrange(len(tokenizer)) for _ in range(60)]
        pieces: list[str] = []
        counting = CountingTokenizer(tokenizer)
        stream = TextStream(counting, emit=pieces.append)
        i = 0
        while i < len(ids):
            n = rng.randrange(1, 6)  # rounds commit 1..5 tokens
            stream.push(ids[i:i + n])
            i += n
        text = stream.finish()
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == text
        if trial % 2 == 0:
            # The window: the rounds since the one before the last that completed a character (this byte-level
            # tokenizer splits every multi-byte character); a few rounds, not the whole ~300-token output.
            assert counting.longest <= 40 < len(ids), "each round should decode a window, not everything"


def test_stop_string_split_across_rounds(tiny_target):
    tokenizer = tiny_target.tokenizer
    ids = tokenizer("alpha beta STOP gamma")["input_ids"]
    pieces: list[str] = []
    stream = TextStream(tokenizer, stop=["STOP"], emit=pieces.append)
    stopped = False
    for token in ids:
        if stream.push([token]):
            stopped = True
            break
    assert stopped and stream.finish() == "alpha beta " and "".join(pieces) == "alpha beta "

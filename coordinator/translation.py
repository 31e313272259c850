"""Drafting across tokenizers: a drafter whose token ids are not the target's, translated through text.

Each round the drafter's proposal (drafter token ids) is decoded to text and re-encoded with the target's tokenizer
together with a few committed target tokens before it, so that tokens merging across the boundary come out as the
target would tokenize them (HF transformers' universal assisted generation does the same). The drafter's history is
kept in drafter tokens, re-tokenized from the committed target text after every round: a prefix of it that no later
text can change ("stable": it ends `window` drafter tokens before the end, at a point where both tokenizations cut
the text at the same character) is committed to the drafter session and never resent; the tail after it rides along
with each proposal, and the drafter keeps its KV cache wherever the re-tokenized tail keeps the same prefix.

Exactness does not depend on the translation: the target verifies target tokens. Greedy output is the target's own;
when sampling, a translated draft token was not drawn from a distribution over the target's vocabulary, so it is sent
as a deterministic proposal (q = 1 on that token), for which the accept/reject rule (accept with probability p(x),
else sample from norm(max(0, p - q))) emits exactly the target's distribution p.

Text round trips are exact for byte-level BPE tokenizers (GPT-2, Qwen, Llama 3, SmolLM); with others (SentencePiece)
the output stays exact and only acceptance can suffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.loop import Draft, DraftSource
from specmesh.decoding.sampling import SparseDist

REPLACEMENT = "\ufffd"  # what a decoder renders for bytes that are not (yet) a whole UTF-8 character
DEFAULT_WINDOW = 8


def deterministic_proposal(token: int) -> SparseDist:
    """q = 1 on `token`: how a draft token not drawn from a target-vocabulary distribution is verified exactly."""
    return SparseDist((token,), (1.0,))


@dataclass(frozen=True)
class TextCodec:
    """One tokenizer's side of a text round trip: text between two positions of a token sequence, and the tokens that
    continue a sequence with a given text."""

    tokenizer: object
    window: int = DEFAULT_WINDOW  # tokens of context on either side of a boundary

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def decode(self, ids: Sequence[int]) -> str:
        # Special tokens are kept as text: chat markers (<|im_end|>) then mean the same to both tokenizers when both
        # have them, and a drafter's end-of-turn becomes the target's.
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def text_between(self, ids: Sequence[int], start: int, end: int) -> tuple[str, bool]:
        """The text ids[start:end] adds after ids[:start], decoded with up to `window` tokens before `start` as
        context (SentencePiece renders a token differently at the start of a text). Returns (text, complete): a
        trailing incomplete UTF-8 character is left out, and complete is False then."""
        context = max(0, start - self.window)
        known = self.decode(ids[context:start])
        full = self.decode(ids[context:end])
        if not full.startswith(known):  # ids[:start] ends mid-character: the completed character starts the text
            known = known.rstrip(REPLACEMENT)
        text = full[len(known):]
        trimmed = text.rstrip(REPLACEMENT)
        return trimmed, trimmed == text

    def continuation(self, ids: Sequence[int], text: str) -> list[int]:
        """Tokens that continue `ids` with `text`, as this tokenizer cuts the last `window` tokens' text followed by
        `text`; where that would re-cut the tokens already in `ids` (a merge into committed text), `text` on its
        own."""
        if not text:
            return []
        start = max(0, len(ids) - self.window)
        window_text, complete = self.text_between(ids, start, len(ids))
        encoded = self.encode(window_text + text)
        window_ids = list(ids[start:])
        if encoded[:len(window_ids)] == window_ids:
            return encoded[len(window_ids):]
        # `ids` ends mid-character: `text` starts with the rest of that character, so it cannot stand alone.
        return self.encode(text) if complete else []

    def leading_specials(self) -> list[int]:
        """The tokens this tokenizer puts before any text (a BOS), which a model trained with them expects."""
        bare = self.encode("a")
        full = list(self.tokenizer("a", add_special_tokens=True)["input_ids"])
        cut = len(full) - len(bare)
        return full[:cut] if cut > 0 and full[cut:] == bare else []


class TokenTranslator:
    """The target's and the drafter's tokenizers, and the text round trips between their token ids."""

    def __init__(self, target_tokenizer, drafter_tokenizer, window: int = DEFAULT_WINDOW) -> None:
        self.target = TextCodec(target_tokenizer, window)
        self.drafter = TextCodec(drafter_tokenizer, window)
        self.window = window

    def target_draft(self, context: Sequence[int], text: str) -> list[int]:
        """Target tokens for a drafted `text` after the target tokens `context`: the path of every drafter whose
        proposals are strings."""
        return self.target.continuation(context, text)

    def drafter_tail(self, target_ids: Sequence[int], start: int, drafter_ids: Sequence[int]) -> list[int]:
        """Drafter tokens for the text target_ids[start:] adds, following `drafter_ids` (which hold the text of
        target_ids[:start])."""
        text, _ = self.target.text_between(target_ids, start, len(target_ids))
        return self.drafter.continuation(drafter_ids, text)

    def drafted_text(self, drafter_ids: Sequence[int], proposal: Sequence[int]) -> str:
        """The text a drafter's `proposal` adds after its history `drafter_ids` (whole characters only)."""
        sequence = [*drafter_ids, *proposal]
        return self.drafter.text_between(sequence, len(drafter_ids), len(sequence))[0]

    def aligned_cut(self, target_ids: Sequence[int], target_start: int, drafter_ids: Sequence[int],
                    drafter_start: int, drafter_end: int) -> tuple[int, int] | None:
        """The latest (target position, drafter position) past the starts, with the drafter position at most
        `drafter_end`, where both token sequences cut their common text at the same character; None if there is
        none. Positions inside a character, or whose texts differ (a tokenizer that does not round-trip), never
        qualify. Only the last 4 windows' positions are tried: a tokenizer that never aligns keeps a growing tail (each
        round then re-tokenizes it) instead of searching the whole history every round."""
        for j in range(drafter_end, max(drafter_start, drafter_end - 4 * self.window), -1):
            text, complete = self.drafter.text_between(drafter_ids, drafter_start, j)
            if not (complete and text):
                continue
            i = self._target_position(target_ids, target_start, len(text))
            if i is not None and self.target.text_between(target_ids, target_start, i) == (text, True):
                return i, j
        return None

    def _target_position(self, target_ids: Sequence[int], start: int, length: int) -> int | None:
        """The first position whose text after `start` has at least `length` characters (a binary search: the text
        only grows with the position)."""
        low, high = start + 1, len(target_ids)
        if high < low:
            return None
        while low < high:
            middle = (low + high) // 2
            if len(self.target.text_between(target_ids, start, middle)[0]) < length:
                low = middle + 1
            else:
                high = middle
        return low


class TranslatingDraftSource:
    """A DraftSource in target tokens over a drafter session in drafter tokens (coordinator/loop.py's seam).

    `open_drafter(prompt)` opens the drafter session with its prompt in drafter tokens. Only the stable part of the
    drafter's history is committed to it (`update`); the rest is re-tokenized each round and sent as the `after`
    tokens of each proposal, so a changed tail is resent, never the whole history."""

    def __init__(self, translator: TokenTranslator, prompt: Sequence[int],
                 open_drafter: Callable[[list[int]], DraftSource]) -> None:
        self.translator = translator
        self.target_ids: list[int] = list(prompt)
        self.stable_target = 0  # target_ids[:stable_target] have the text of self.stable_drafter
        self.stable_drafter: list[int] = translator.drafter.leading_specials()
        self.tail: list[int] = []  # drafter tokens for the text of target_ids[stable_target:]
        self.session: DraftSource | None = None
        self._resync()
        self.session = open_drafter(list(self.stable_drafter))

    @property
    def drafter_ids(self) -> list[int]:
        """The drafter's whole history: the committed text in drafter tokens."""
        return [*self.stable_drafter, *self.tail]

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        context = [*self.target_ids, *after]
        tail = (self.translator.drafter_tail(context, self.stable_target, self.stable_drafter) if after
                else self.tail)
        proposal = self.session.propose(k, tail)
        if not proposal.tokens:
            return Draft()
        text = self.translator.drafted_text([*self.stable_drafter, *tail], proposal.tokens)
        tokens = tuple(self.translator.target_draft(context, text)[:k])
        # Sampling: the drafter's q is over its own vocabulary; the translated token is a deterministic proposal.
        dists = tuple(deterministic_proposal(t) for t in tokens) if proposal.dists else ()
        return Draft(tokens, dists)

    def update(self, committed: Sequence[int]) -> None:
        self.target_ids.extend(committed)
        self._resync()

    def _resync(self) -> None:
        """Re-tokenize the text after the stable prefix, then move the stable prefix up to the latest aligned cut
        `window` drafter tokens before the end (text that far back no longer changes its tokens)."""
        self.tail = self.translator.drafter_tail(self.target_ids, self.stable_target, self.stable_drafter)
        history = self.drafter_ids
        base = len(self.stable_drafter)
        end = len(history) - self.translator.window
        cut = (self.translator.aligned_cut(self.target_ids, self.stable_target, history, base, end)
               if end > base else None)
        if cut is None:
            return
        target_cut, drafter_cut = cut
        newly_stable = history[base:drafter_cut]
        self.stable_target, self.stable_drafter, self.tail = target_cut, history[:drafter_cut], history[drafter_cut:]
        if self.session is not None:  # else the session opens with the stable prefix as its prompt
            self.session.update(newly_stable)

    def end(self) -> None:
        self.session.end()

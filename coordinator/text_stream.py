"""Incremental detokenisation with stop strings: emit text as soon as it is final, never past a stop string.

Decoding is incremental as in TGI and vLLM: each round decodes only a short window, from a few tokens before the new
ones (so tokenizers that render a token differently at the start of a text, like SentencePiece's leading space, see
their context) to the end, and appends the difference. A window ending in an incomplete UTF-8 character (a byte-level
token split mid-character) is left pending until the next tokens complete it. Cost per round is the window, not the
whole output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = (), emit: Callable[[str], None] | None = None) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._emit = emit
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: the previous round's tokens, as context
        self._read_offset = 0  # tokens before this are in `text`
        self._emitted = 0  # characters of `text` already handed to `emit`
        self.text = ""
        self.stopped = False

    def push(self, tokens: Sequence[int]) -> bool:
        """Add committed tokens; returns True once a stop string has appeared (the text is cut before it)."""
        self._ids.extend(tokens)
        self.text += self._decode_new(final=False)
        # Only text from (emitted - longest stop) onward can hold a stop string that is new in this round.
        search_from = max(0, self._emitted - max((len(s) for s in self._stop), default=0))
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
            self._flush(len(self.text))
            return True
        # Hold back what could still become a stop string.
        self._flush(len(self.text) - max((len(s) - 1 for s in self._stop), default=0))
        return False

    def finish(self) -> str:
        if not self.stopped:
            self.text += self._decode_new(final=True)
        self._flush(len(self.text))
        return self.text

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past the read offset; "" while it ends in a partial character (unless `final`)."""
        decode = self._tokenizer.decode
        known = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        window = decode(self._ids[self._prefix_offset:], skip_special_tokens=True)
        if len(window) <= len(known) or (window.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window[len(known):]

    def _flush(self, upto: int) -> None:
        if upto > self._emitted:
            if self._emit is not None:
                self._emit(self.text[self._emitted:upto])
            self._emitted = upto

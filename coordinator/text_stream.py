"""Incremental detokenisation with stop strings: emit text as soon as it is final, never past a stop string."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = (), emit: Callable[[str], None] | None = None) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._emit = emit
        self._ids: list[int] = []
        self._emitted = 0  # characters of `text` already handed to `emit`
        self.text = ""
        self.stopped = False

    def push(self, tokens: Sequence[int]) -> bool:
        """Add committed tokens; returns True once a stop string has appeared (the text is cut before it)."""
        self._ids.extend(tokens)
        self.text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        # Only text from (emitted - longest stop) onward can hold a stop string that is new in this round.
        search_from = max(0, self._emitted - max((len(s) for s in self._stop), default=0))
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
            self._flush(len(self.text))
            return True
        # Hold back what could still become a stop string, and a trailing partial UTF-8 character.
        safe = len(self.text) - max((len(s) - 1 for s in self._stop), default=0)
        while safe > self._emitted and self.text[safe - 1] == "\ufffd":
            safe -= 1
        self._flush(safe)
        return False

    def finish(self) -> str:
        self._flush(len(self.text))
        return self.text

    def _flush(self, upto: int) -> None:
        if upto > self._emitted:
            if self._emit is not None:
                self._emit(self.text[self._emitted:upto])
            self._emitted = upto

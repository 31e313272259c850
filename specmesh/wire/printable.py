"""Outside text made safe to echo: a request field, a client's raw bytes, a command-line argument or an exception
that may carry any of them, put into an error response, a gRPC status message or a log line.

`printable(value)` is always valid UTF-8 (a lone surrogate or an undecodable byte is written as an escape), holds no
control or other non-printing character (escaped like repr does: \\n, \\x1b, \\u200b, \\udcff), and is at most
`limit` characters long however long the input: a megabyte string costs no more than a short one. It is for people
reading it, not for parsing back: quotes and backslashes are left as they are, so applying it twice changes nothing.
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_KEPT_WITH_NEWLINES = frozenset("\n\t")


def _escape(char: str, from_bytes: bool) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if from_bytes and 0xDC80 <= code <= 0xDCFF:  # an undecodable byte (surrogateescape): as the byte
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _text(value: object, limit: int) -> tuple[str, bool, int, str]:
    """(text, whether that is all of it, the whole length, the unit of that length): bytes decoded with invalid ones
    as lone surrogates (surrogateescape; written as \\xNN), a string as it is, anything else as str() gives it; of
    what is long only a prefix, enough to fill `limit`."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value[:4 * limit + 4])  # a character is at most 4 bytes of UTF-8
        return data.decode("utf-8", "surrogateescape"), len(data) == len(value), len(value), "bytes"
    if not isinstance(value, str):
        try:
            value = str(value)
        except Exception:  # a broken __str__ must not break the error message that mentions it
            try:
                value = repr(value)
            except Exception:
                value = f"<unprintable {type(value).__name__}>"
        if not isinstance(value, str):  # a str subclass' __str__ may return anything
            value = f"<unprintable {type(value).__name__}>"
    return value[:limit + 1], len(value) <= limit + 1, len(value), "characters"


def printable(value: object, limit: int = 200, *, newlines: bool = False) -> str:
    """`value` (text, bytes, an exception, anything) as valid UTF-8 without control characters, at most `limit`
    characters: what is cut off is replaced by '... [N characters]' (N: the whole length). `newlines`: keep line
    breaks and tabs (multi-line messages to a terminal, such as a worker's log tail); everything else non-printable is
    still escaped."""
    limit = max(0, int(limit))
    text, complete, whole, unit = _text(value, limit)
    from_bytes = unit == "bytes"
    pieces: list[str] = []
    size = 0
    for char in text:
        piece = char if char.isprintable() or (newlines and char in _KEPT_WITH_NEWLINES) else _escape(char, from_bytes)
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            break
    else:
        if complete:
            return "".join(pieces)
    suffix = f"... [{whole} {unit}]"
    if len(suffix) > limit:  # too small a limit to say how much was cut: just cut
        suffix = ""
    room = limit - len(suffix)
    while pieces and size > room:  # whole escapes only: never half of one
        size -= len(pieces.pop())
    return "".join(pieces) + suffix

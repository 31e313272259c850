"""printable(): what error messages and log lines echo of outside input is valid UTF-8, free of control characters and
bounded, whatever the input (specmesh/wire/printable.py)."""

from __future__ import annotations

import pytest

from specmesh.wire.printable import printable
from specmesh.wire.validation import check_session_id
from specmesh.worker.malformed_requests import MalformedRequest, _tolerant


def safe(text: str) -> bool:
    text.encode("utf-8")  # raises on a lone surrogate
    return text.isprintable()


@pytest.mark.parametrize("value, shown", [
    ("tiny-random-qwen2", "tiny-random-qwen2"),
    ("\ud800tiny", "\\ud800tiny"),  # lone surrogates, as JSON escapes (or raw bytes json.loads passes) spell them
    ("a\udfffb\udc80", "a\\udfffb\\udc80"),
    ("a\x00b\x1b[31mc\x7fd\x9b", "a\\x00b\\x1b[31mc\\x7fd\\x9b"),  # NUL, an ANSI escape, DEL, a C1 control
    ("line\nbreak\r\ttab", "line\\nbreak\\r\\ttab"),
    ("\u202eevil\u200b\u2028", "\\u202eevil\\u200b\\u2028"),  # bidi override, zero width space, line separator
    ("é 日本 😀 'quotes' \"and\" \\backslash", "é 日本 😀 'quotes' \"and\" \\backslash"),  # printable: as it is
    ("", ""),
])
def test_text_is_escaped_where_it_is_not_printable(value, shown):
    assert printable(value) == shown
    assert safe(printable(value))


@pytest.mark.parametrize("value, shown", [
    (b"\xff\xfe", "\\xff\\xfe"),
    (b"\xed\xa0\x80model", "\\xed\\xa0\\x80model"),  # a surrogate encoded in UTF-8 (CESU): not UTF-8
    (b"\xc3\x28", "\\xc3("),
    (b"caf\xc3\xa9", "café"),
    (bytearray(b"\x00\x01"), "\\x00\\x01"),
])
def test_bytes_are_decoded_with_invalid_ones_escaped(value, shown):
    assert printable(value) == shown


def test_a_megabyte_string_is_capped():
    for value, unit in (("x" * 1_000_000, "characters"), ("\ud800" * 1_000_000, "characters"),
                        ("\x00" * 1_000_000, "characters"), (b"\xff" * 1_000_000, "bytes"),
                        ("日" * 1_000_000, "characters")):
        shown = printable(value)
        assert len(shown) <= 200 and safe(shown)
        assert shown.endswith(f"... [1000000 {unit}]")
    assert len(printable("x" * 1_000_000, limit=50)) == 50
    assert printable("x" * 1_000_000, limit=10_000).startswith("x" * 9_000)


def test_the_cap_never_cuts_an_escape_in_half():
    for limit in range(0, 60):
        for value, escape in (("\ud800" * 100, "\\ud800"), (b"\xff" * 100, "\\xff"),
                              ("\U000e0001" * 100, "\\U000e0001")):
            shown = printable(value, limit=limit)
            assert len(shown) <= limit and safe(shown)
            body = shown.split("... [")[0]
            assert body == escape * (len(body) // len(escape))
    assert printable("abc", limit=3) == "abc"  # exactly at the limit: nothing cut
    assert printable("abcd", limit=3) == "abc"  # too small a limit to say how much was cut


def test_anything_else_is_shown_as_str_gives_it():
    class Broken:
        def __str__(self):
            raise RuntimeError("no")

        def __repr__(self):
            raise RuntimeError("no")

    assert printable(ValueError("bad model `\ud800`")) == "bad model `\\ud800`"
    assert printable(None) == "None" and printable(42) == "42"
    assert printable(Broken()) == "<unprintable Broken>"


def test_newlines_may_be_kept_for_terminal_messages():
    assert printable("a\nb\tc\rd\x1b", newlines=True) == "a\nb\tc\\rd\\x1b"


def test_printable_twice_is_printable_once():
    for value in ("\ud800\x00x" * 100, "plain", "x" * 10_000, b"\xff" * 500):
        assert printable(printable(value)) == printable(value)


def test_a_malformed_grpc_request_reason_is_printable():
    """A deserializer error that quotes the request's bytes (or is huge) becomes a short, printable status message:
    grpcio cannot send one that is not valid UTF-8."""
    def deserialize(data: bytes):
        raise ValueError(f"cannot decode {data.decode('utf-8', 'surrogateescape')!s}" + "\x00" * 10_000)
    request = _tolerant(deserialize)(b"\xff\xfe session")
    assert isinstance(request, MalformedRequest)
    assert safe(request.reason) and len(request.reason) <= 300
    assert request.reason.startswith("cannot decode \\udcff\\udcfe session\\x00")


@pytest.mark.parametrize("session_id", ["\x00\x1b[31m", "ok\u202e", "\x07" * 100, "x" * 1_000_000])
def test_a_session_id_the_workers_refuse_is_quoted_printably(session_id):
    with pytest.raises(ValueError) as refused:
        check_session_id(session_id)
    assert safe(str(refused.value)) and len(str(refused.value)) <= 120

"""Hypothesis strategies for random and malformed specmesh requests, and every input a fuzzer has found failing
(FOUND_*); shared by tests/test_fuzz.py and scripts/fuzz.py."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable

import grpc
from hypothesis import example
from hypothesis import strategies as st

from specmesh.v1 import specmesh_pb2 as pb

INT32 = st.integers(min_value=-2**31, max_value=2**31 - 1)
UINT32 = st.integers(min_value=0, max_value=2**32 - 1)
UINT64 = st.integers(min_value=0, max_value=2**64 - 1)
# Mostly plausible token ids (the tiny models have 320), sometimes anything an int32 can hold.
TOKEN = st.one_of(st.integers(min_value=0, max_value=330), INT32)
TOKENS = st.lists(TOKEN, max_size=40)
# allow_subnormal=False: the servers flush denormals to zero (torch.set_flush_denormal), process-wide.
FLOAT = st.one_of(st.floats(min_value=0, max_value=2, width=32, allow_subnormal=False),
                  st.floats(width=32, allow_subnormal=False))
SESSION_ID = st.one_of(st.sampled_from(["s1", "s2", "fuzz"]),
                       st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
SAMPLING = st.one_of(st.builds(pb.SamplingParams),
                     st.builds(pb.SamplingParams, temperature=FLOAT, top_k=INT32, top_p=FLOAT))
CONTEXT = st.one_of(
    st.builds(pb.ContextSync, base_length=st.just(0), base_hash=st.just(0xCBF29CE484222325), new_tokens=TOKENS),
    st.builds(pb.ContextSync, base_length=UINT64, base_hash=UINT64, new_tokens=TOKENS))
DIST = st.builds(pb.SparseDistribution, token_ids=TOKENS, probs=st.lists(FLOAT, max_size=40))

VERIFY = st.builds(pb.VerifyRequest, session_id=SESSION_ID, context=CONTEXT, draft_tokens=TOKENS,
                   draft_distributions=st.lists(DIST, max_size=6), sampling=SAMPLING, seed=UINT64)
PROPOSE = st.builds(pb.ProposeRequest, session_id=SESSION_ID, context=CONTEXT,
                    num_tokens=st.one_of(st.integers(min_value=0, max_value=40), UINT32), sampling=SAMPLING,
                    seed=UINT64)
END = st.builds(pb.EndSessionRequest, session_id=SESSION_ID)

# What a well-behaved server may answer to arbitrary input; INTERNAL/UNKNOWN would mean a handler crashed and
# DEADLINE_EXCEEDED that it hung.
PROPER = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})


def call(stub_method, request, timeout_s: float = 20.0) -> grpc.StatusCode:
    try:
        stub_method(request, timeout=timeout_s)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def send_garbage(port: int, garbage: bytes, reply_timeout_s: float) -> None:
    """Open a raw TCP connection to a loopback server, send bytes that are not HTTP/2, read what comes back, close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(garbage)
        raw.settimeout(reply_timeout_s)
        try:
            raw.recv(1024)
        except (socket.timeout, ConnectionError):
            pass


# The HTTP API (coordinator serve): a request is (method, path, body bytes, content type). Bodies start from a valid
# completion or chat request that generates a few tokens at most, then are mutated: unknown fields, wrong types,
# huge values, malformed JSON, invalid UTF-8, lone surrogates, oversized bodies.
HTTP_MODEL = "tiny-random-qwen2"
HTTP_BODY_LIMIT = 1024 * 1024  # coordinator.serving.http_api's default max_body_bytes
# Integers and floats that are either tiny or far out of range: a value that a field accepts never asks for a long
# generation (max_tokens, n), so a fuzz request stays quick.
WILD_INT = st.one_of(st.integers(min_value=-2**70, max_value=8), st.integers(min_value=2**21, max_value=2**80))
WILD_FLOAT = st.floats(allow_subnormal=False).filter(lambda x: not 8 < x < 2**21)
JSON_LEAF = st.one_of(st.none(), st.booleans(), WILD_INT, WILD_FLOAT, st.text(max_size=20))
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=10)
TEXT = st.text(max_size=40)
SAMPLING_FIELDS = {"max_tokens": st.integers(min_value=1, max_value=6),
                   "temperature": st.floats(0, 2, allow_subnormal=False),
                   "top_p": st.floats(0.01, 1, allow_subnormal=False), "top_k": st.integers(0, 50),
                   "seed": st.integers(0, 2**64 - 1),
                   "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
                   "n": st.integers(1, 2), "stream": st.booleans(),
                   "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
COMPLETION_BODY = st.fixed_dictionaries({"model": st.just(HTTP_MODEL), "prompt": TEXT.filter(bool)},
                                        optional=SAMPLING_FIELDS)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
                                 "content": TEXT})
CHAT_BODY = st.fixed_dictionaries({"model": st.just(HTTP_MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
                                  optional={**SAMPLING_FIELDS, "max_completion_tokens": st.integers(1, 6)})
HUGE = st.one_of(st.integers(min_value=2**63, max_value=10**400), st.integers(min_value=-10**400, max_value=-2**63),
                 st.sampled_from([1e308, -1e308, 2**64, 2**31, -2**63]),
                 st.integers(min_value=10_000, max_value=200_000).map(lambda n: "x" * n),
                 st.integers(min_value=1_000, max_value=20_000).map(lambda n: ["s"] * n))


def dumps(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


@st.composite
def http_body(draw) -> tuple[str, bytes]:
    """(path, body bytes) of a completion or chat request, valid or mutated one of several ways."""
    chat = draw(st.booleans())
    body = draw(CHAT_BODY if chat else COMPLETION_BODY)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    how = draw(st.sampled_from(["valid", "unknown-fields", "wrong-type", "huge", "malformed-json", "invalid-utf8",
                                "lone-surrogate", "deep-nesting", "not-an-object", "oversized", "garbage"]))
    if how == "unknown-fields":
        body.update(draw(st.dictionaries(st.text(min_size=1, max_size=12), JSON_VALUE, min_size=1, max_size=4)))
    elif how in ("wrong-type", "huge"):
        key = draw(st.sampled_from(sorted({*body, *SAMPLING_FIELDS, "messages", "prompt", "model"})))
        body[key] = draw(JSON_VALUE if how == "wrong-type" else HUGE)
    elif how == "malformed-json":
        raw = dumps(body)
        return path, raw[:draw(st.integers(0, max(0, len(raw) - 1)))] + draw(st.binary(max_size=8))
    elif how == "invalid-utf8":
        raw = dumps(body)
        at = draw(st.integers(0, len(raw)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80"]))
        return path, raw[:at] + bad + raw[at:]
    elif how == "lone-surrogate":
        text = draw(st.sampled_from(["\\ud800", "\\udfff", "a\\ud83d", "\\udc00b"]))
        field = '"messages": [{"role": "user", "content": "%s"}]' % text if chat else '"prompt": "%s"' % text
        return path, ('{"model": "%s", %s, "max_tokens": 2}' % (HTTP_MODEL, field)).encode()
    elif how == "deep-nesting":
        depth = draw(st.integers(100, 100_000))
        return path, b'{"model": "' + HTTP_MODEL.encode() + b'", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    elif how == "not-an-object":
        return path, dumps(draw(JSON_VALUE))
    elif how == "oversized":
        return path, b'{"model": "x", "prompt": "' + b"a" * (HTTP_BODY_LIMIT + draw(st.integers(0, 65536))) + b'"}'
    elif how == "garbage":
        return path, draw(st.binary(max_size=512))
    return path, dumps(body)


@st.composite
def http_request(draw) -> tuple[str, str, bytes, str]:
    """(method, path, body, content type): mostly POSTs of fuzzed bodies, sometimes other routes and methods."""
    path, body = draw(http_body())
    kind = draw(st.integers(0, 9))
    if kind == 0:  # another route or a wrong method
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]))
        path = draw(st.sampled_from([path, "/v1/models", "/health", "/v1/nowhere", "/"]))
        return method, path, body, "application/json"
    content_type = "application/json" if kind > 1 else draw(st.sampled_from(
        ["text/plain", "", "application/x-www-form-urlencoded", "application/json; charset=latin-1"]))
    return "POST", path, body, content_type


HTTP_REQUEST = http_request()


def openai_error(response) -> bool:
    """Whether an httpx response's body is an error in OpenAI's shape, with a message that is printable text."""
    try:
        error = response.json()["error"]
        return isinstance(error["message"], str) and error["message"].isprintable() and \
            isinstance(error["type"], str) and "param" in error and "code" in error
    except (ValueError, KeyError, TypeError):
        return False


UNSHAPED = " (not OpenAI's error shape)"


def http_call(client, method: str, path: str, body: bytes, content_type: str) -> tuple[int | str, bool]:
    """Send one request with an httpx client and read the whole answer (a stream to its end). (status, failed):
    failed is True for a 5xx, an error event inside a 200 stream, a 4xx that is not an error in OpenAI's shape (then
    status says so), or no answer ("hang" on a timeout, "closed" when the connection broke)."""
    import httpx
    headers = {"content-type": content_type} if content_type else {}
    try:
        response = client.request(method, path, content=body, headers=headers)
    except httpx.TimeoutException:
        return "hang", True
    except httpx.TransportError:
        return "closed", True
    if 400 <= response.status_code < 500 and not openai_error(response):
        return f"{response.status_code}{UNSHAPED}", True
    broken_stream = response.status_code == 200 and b'"generation_failed"' in response.content
    return response.status_code, response.status_code >= 500 or broken_stream


# Every input a fuzzer has found failing (or that exercises a failure fixed since), tried first on every run as an
# explicit example: hypothesis's own example database (.hypothesis/) is not committed, so this list is the memory.
# Add each new find here, with what it did.
FOUND_HTTP: list[tuple[str, str, bytes, str]] = [
    # A lone surrogate (a JSON escape) reached the tokenizer, which raised: 500 (now 400, param prompt / content).
    ("POST", "/v1/completions", b'{"model": "%s", "prompt": "\\ud800", "max_tokens": 2}' % HTTP_MODEL.encode(),
     "application/json"),
    ("POST", "/v1/chat/completions",
     b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udfff"}]}' % HTTP_MODEL.encode(),
     "application/json"),
    # top_k beyond int32 overflowed the wire field: 500 (now 400).
    ("POST", "/v1/completions", dumps({"model": HTTP_MODEL, "prompt": "a", "top_k": 2**40, "temperature": 1}),
     "application/json"),
    # A body of any size was read whole (a 3 MB prompt took 22 s to tokenize): now 413 past 1 MiB.
    ("POST", "/v1/completions", dumps({"model": HTTP_MODEL, "prompt": "a" * HTTP_BODY_LIMIT}), "application/json"),
    # Issue 27: a lone surrogate as raw bytes (CESU-8, which json.loads lets through) in the model name; the 404
    # echoed it and could not be encoded: 500 and a traceback (now 404 with the name printable).
    ("POST", "/v1/completions", b'{"model": "\xed\xa0\x80tiny-random-qwen2", "prompt": "0"}', "application/json"),
]
# Request bytes that are not the method's message (a string field of invalid UTF-8, a truncated field, a bad wire
# type) were answered INTERNAL ("Exception deserializing request!"): now INVALID_ARGUMENT
# (specmesh/worker/malformed_requests.py).
FOUND_GARBAGE_BODY: list[bytes] = [
    b"\xff\xff\xff\xff",  # field number 0 / a truncated varint
    b"\x12\xff\xff\xff\xff\x0f",  # field 2 (context) claims a 4 GB length
    b"\x0a\x02\xc3\x28",  # session_id (a string) that is not UTF-8
    b"\x0a\x05ab",  # a string field shorter than its length
    b"\x0f",  # wire type 7 does not exist
]
# Not finds, but kept with them: hostile session ids (control and invisible format characters, far too long), each
# INVALID_ARGUMENT.
FOUND_VERIFY = [pb.VerifyRequest(session_id=s) for s in ("\x00\x1b[31m", "\u202e\u200b", "x" * 100_000)]
FOUND_PROPOSE = [pb.ProposeRequest(session_id=s, num_tokens=1) for s in ("\x00\x1b[31m", "x" * 100_000)]
FOUND_END = [pb.EndSessionRequest(session_id=s) for s in ("\x00\x1b[31m", "x" * 100_000)]


def found(argument: str, cases: list) -> Callable:
    """A decorator: each of `cases` as an explicit hypothesis example of the test's `argument`, in order."""
    def decorate(test: Callable) -> Callable:
        for case in reversed(cases):
            test = example(**{argument: case})(test)
        return test
    return decorate

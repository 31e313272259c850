"""Hostile values in every field of every HTTP endpoint (coordinator/serving/http_api.py): a lone surrogate (as a JSON escape,
and as the raw bytes json.loads lets through), control characters, invisible format characters, a 1 MB string and
invalid UTF-8 bytes in the raw body. Each request gets a 4xx in OpenAI's error shape with a short, printable message
(or a 200 where the value is legitimately accepted: a prompt of control characters), never a 5xx; and the server
keeps serving, exactly, afterwards. Not random: every combination, every run (tests/test_fuzz.py fuzzes)."""

from __future__ import annotations

import copy
import json
import logging
from types import SimpleNamespace
from urllib.parse import quote

import httpx
import pytest
from starlette.testclient import TestClient

from coordinator import Coordinator, GenerationOptions
from coordinator.serving.http_api import (MESSAGE_LIMIT, PARAM_LIMIT, ChatRequest, CompletionRequest, SafeJSONResponse,
                                  create_app)
from drafter.service import run_server as run_drafter
from specmesh.wire.printable import printable
from tests.coordinator.serving.live_http import serving
from tests.helpers import reference_greedy
from verifier.service import run_server as run_verifier

MODEL = "tiny-random-qwen2"

# name -> a string (sent as JSON escapes where it needs them), or raw bytes put between the quotes as they are
HOSTILE: dict[str, str | bytes] = {
    "lone-surrogate": "\ud800",
    "lone-surrogate-tail": "tiny\udfff",
    "lone-surrogate-raw": b"\xed\xa0\x80",  # a surrogate in CESU-8: json.loads(bytes) decodes with surrogatepass
    "control": "\x00\x07\x08\x1b[31m\r\n\x7f\x9b",
    "format": "\u202e\u200b\ufeff\u2028",
    "megabyte": "x" * 1_000_000,  # with the rest of the request still under the 1 MiB body limit: it is read
    "invalid-utf8": b"\xff\xfe\xc3\x28",
}
NOT_UNICODE = {"lone-surrogate", "lone-surrogate-tail", "lone-surrogate-raw", "invalid-utf8"}
PLACEHOLDER = "@@hostile@@"
UNKNOWN_KEY = ("<a field named by the value>",)

BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
                             "temperature": 0},
}
# Every field of the request models (a new field is covered as soon as it exists), the elements and members of the
# structured ones, and an unknown field whose name is the value.
NESTED = {"prompt": [("prompt", 0)], "stop": [("stop", 0)], "stream_options": [("stream_options", "include_usage")],
          "messages": [("messages", 0), ("messages", 0, "role"), ("messages", 0, "content")]}
MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}
FIELDS = {endpoint: [path for name in model.model_fields for path in [(name,), *NESTED.get(name, [])]] + [UNKNOWN_KEY]
          for endpoint, model in MODELS.items()}
TEXT_FIELDS = {("model",), ("prompt",), ("prompt", 0), ("stop",), ("stop", 0), ("messages", 0, "role"),
               ("messages", 0, "content"), UNKNOWN_KEY}


def with_value(body: dict, path: tuple, value) -> dict:
    """A copy of `body` with `value` at `path`, making the lists and objects on the way (a prompt becomes a list)."""
    body = copy.deepcopy(body)
    if path == UNKNOWN_KEY:
        body[value] = 1
        return body
    node = body
    for key, inner in zip(path, path[1:]):
        present = key < len(node) if isinstance(node, list) else key in node
        if not (present and isinstance(node[key], (dict, list))):
            node[key] = [] if isinstance(inner, int) else {}
        node = node[key]
    if isinstance(node, list) and path[-1] >= len(node):
        node.append(value)
    else:
        node[path[-1]] = value
    return body


def encode(body: dict, path: tuple, hostile: str | bytes) -> bytes:
    if isinstance(hostile, str):
        return json.dumps(with_value(body, path, hostile)).encode()  # ensure_ascii: "\ud800", "\u0000", ...
    raw = json.dumps(with_value(body, path, PLACEHOLDER)).encode()
    return raw.replace(f'"{PLACEHOLDER}"'.encode(), b'"' + hostile + b'"')


def assert_openai_error(response: httpx.Response) -> str:
    """The error's message, after checking OpenAI's shape and that the message is short, printable UTF-8."""
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and isinstance(error["type"], str) and error["message"], error
    message = error["message"]
    message.encode("utf-8")
    assert message.isprintable() and len(message) <= MESSAGE_LIMIT, message[:300]
    assert error["param"] is None or (error["param"].isprintable() and len(error["param"]) <= PARAM_LIMIT)
    return message


@pytest.fixture(scope="module")
def coordinator(tiny_target, tiny_unrelated_draft):
    with run_verifier(tiny_target, port=0) as v, run_drafter(tiny_unrelated_draft, port=0) as d:
        with Coordinator(v.address, d.address, tokenizer=tiny_target.tokenizer) as c:
            yield c


@pytest.fixture(scope="module")
def http(coordinator):
    with serving(create_app(coordinator, default_max_tokens=2)) as (url, _):
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client


CASES = [pytest.param(endpoint, path, name, stream, id=f"{endpoint}-{'.'.join(map(str, path))}-{name}"
                      + ("-stream" if stream else ""))
         for endpoint, paths in FIELDS.items() for path in paths for name in HOSTILE
         for stream in ([False, True] if path in TEXT_FIELDS else [False])]


@pytest.mark.parametrize("endpoint, path, name, stream", CASES)
def test_hostile_values_get_a_client_error_or_are_accepted(http, endpoint, path, name, stream):
    body = {**BODIES[endpoint], "stream": True} if stream else BODIES[endpoint]
    response = http.post(endpoint, content=encode(body, path, HOSTILE[name]),
                         headers={"content-type": "application/json"})
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text[:500]
    if response.status_code != 200:
        message = assert_openai_error(response)
        if path == ("model",) and name not in ("invalid-utf8", "lone-surrogate-raw"):
            assert response.status_code == 404 and printable(HOSTILE[name], 100) in message
        return
    # Accepted: then the value was legitimate text where text belongs (or a field the server ignores), and the
    # answer is a whole completion.
    assert path in TEXT_FIELDS and (name not in NOT_UNICODE or path == UNKNOWN_KEY), response.text[:500]
    if stream:
        assert response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text, response.text[:500]
    else:
        assert response.json()["choices"], response.text[:500]


@pytest.mark.parametrize("hostile", ["%ED%A0%80", "%FF%FE", "%00%1B%5B31m%0D%0A", quote("\u202e\u200b"),
                                     "x" * 4000])
def test_hostile_paths_and_query_strings(http, hostile):
    """The routes without a body: a query string they ignore is no error; an unknown route or a wrong method is a
    404 or 405 in OpenAI's shape that names the path printably."""
    assert http.get(f"/v1/models?name={hostile}").status_code == 200
    assert http.get(f"/health?{hostile}={hostile}").status_code == 200
    for method, path, status in (("GET", f"/v1/{hostile}", 404), ("POST", f"/{hostile}", 404),
                                 ("POST", "/v1/models", 405), ("GET", "/v1/completions", 405),
                                 ("DELETE", f"/v1/chat/completions?x={hostile}", 405)):
        response = http.request(method, path)
        assert response.status_code == status, response.text[:500]
        assert_openai_error(response)


def test_the_issue_27_model_name_is_a_404(http):
    """Found by the fuzzer (tests/test_fuzz.py): a 500 and a traceback, as the 404 echoed the lone surrogate."""
    response = http.post("/v1/completions", content=b'{"model": "\xed\xa0\x80tiny-random-qwen2", "prompt": "0"}',
                         headers={"content-type": "application/json"})
    assert response.status_code == 404
    assert "`\\ud800tiny-random-qwen2`" in assert_openai_error(response)
    assert response.json()["error"]["code"] == "model_not_found"


def test_the_server_keeps_serving_exactly(http, coordinator, tiny_target):
    test_the_issue_27_model_name_is_a_404(http)
    for endpoint, path in (("/v1/completions", ("model",)), ("/v1/chat/completions", ("messages", 0, "content"))):
        for hostile in HOSTILE.values():  # a burst of hostile requests first, also when this test runs alone
            http.post(endpoint, content=encode(BODIES[endpoint], path, hostile),
                      headers={"content-type": "application/json"})
    assert http.get("/health").json()["status"] == "ok"
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
    prompt = "def add(a, b):"
    ids = tiny_target.tokenizer(prompt)["input_ids"]
    want = coordinator.generate(list(ids), GenerationOptions(max_new_tokens=12))
    assert want.token_ids == reference_greedy(tiny_target.model, ids, 12, set(tiny_target.eos_token_ids))
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == want.text


def test_whatever_escapes_is_still_answered_in_openai_shape(caplog):
    """The last resort (coordinator.serving.http_api.LastResort): a bug's exception, even one quoting the request, is a 500
    with a printable message and a printable log line; a UnicodeError (only a request brings text that is not
    Unicode) a 400; and a response holding what JSON or UTF-8 cannot still renders."""
    app = create_app(SimpleNamespace(verifier_info=SimpleNamespace(model_name=MODEL)))

    def crash():
        raise RuntimeError("a bug quoting \ud800\x1b[2J" + "x" * 1_000_000)

    def not_unicode():
        "\ud800".encode()

    def unencodable():
        return SafeJSONResponse({"text": "a\ud800", "nan": float("nan"), "\udfff": [b"\xff"]})

    for path, route in (("/crash", crash), ("/not-unicode", not_unicode), ("/unencodable", unencodable)):
        app.add_api_route(path, route)
    with caplog.at_level(logging.WARNING, logger="specmesh.http"), TestClient(app) as client:
        crashed = client.get("/crash")
        assert crashed.status_code == 500 and "RuntimeError" in assert_openai_error(crashed)
        assert crashed.json()["error"]["type"] == "server_error"
        logged = caplog.records[-1].getMessage()
        assert "a bug quoting \\ud800\\x1b[2J" in logged and len(logged) < 30_000
        logged.encode("utf-8")
        refused = client.get("/not-unicode")
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_unicode"
        assert_openai_error(refused)
        rendered = client.get("/unencodable")
        assert rendered.status_code == 200
        assert rendered.json() == {"text": "a\\ud800", "nan": None, "\\udfff": ["\\xff"]}
        assert client.get("/v1/models").status_code == 200  # still serving

"""The OpenAI-compatible HTTP API, driven by the official `openai` client against a live server on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from coordinator import Coordinator, GenerationOptions
from coordinator.serving.http_api import create_app
from drafter.service import run_server as run_drafter
from verifier.service import run_server as run_verifier

MODEL = "tiny-random-qwen2"
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def coordinator(tiny_target, tiny_unrelated_draft):
    with run_verifier(tiny_target, port=0) as v, run_drafter(tiny_unrelated_draft, port=0) as d:
        with Coordinator(v.address, d.address, tokenizer=tiny_target.tokenizer) as c:
            yield c


@pytest.fixture(scope="module")
def base_url(coordinator):
    listener = socket.create_server(("127.0.0.1", 0))
    # The heuristic always drafts; the (default) cost policy may decide that the tiny draft does not pay here.
    app = create_app(coordinator, default_max_tokens=16, draft_policy="heuristic")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.02)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def expected_text(coordinator, prompt_ids, max_tokens=24):
    return coordinator.generate(list(prompt_ids), GenerationOptions(max_new_tokens=max_tokens))


def test_completion_equals_generate(client, coordinator):
    want = expected_text(coordinator, coordinator.encode_prompt(PROMPT, chat=False))
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == want.prompt_tokens
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_streaming_completion_equals_generate(client, coordinator):
    want = expected_text(coordinator, coordinator.encode_prompt(PROMPT, chat=False))
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert len([c for c in chunks if c.choices]) > 2  # really streamed, not one blob
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_completion_and_streaming(client, coordinator):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    want = expected_text(coordinator, coordinator.encode_messages(messages))
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text


def test_stop_seed_and_n(client, coordinator):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[4:6]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].text == full[:full.index(stop)] and stopped.choices[0].finish_reason == "stop"
    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1, seed=5, n=2)
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1, seed=5, n=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2


def test_concurrent_requests(client, coordinator):
    want = expected_text(coordinator, coordinator.encode_prompt(PROMPT, chat=False), 16).text
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda _: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                                                   temperature=0).choices[0].text, range(4)))
    assert texts == [want] * 4


def test_models_health_and_errors(client, base_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(base_url + "/health").json()["status"] == "ok"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert missing.value.body["code"] == "model_not_found"
    for bad in ({"max_tokens": -1}, {"temperature": -2}, {"top_p": 3}, {"n": 0}):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL, prompt="x", **bad)
        assert error.value.body["type"] == "invalid_request_error"
    reply = httpx.post(base_url + "/v1/chat/completions", content=b"{not json", headers={"content-type":
                                                                                         "application/json"})
    assert reply.status_code == 400 and "error" in reply.json()
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices  # still serving


def processes_with(variable: str, value: str) -> list[int]:
    """PIDs of the processes whose environment holds variable=value (children inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"{variable}={value}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return found


def test_coordinator_serve_cli(tmp_path):
    mark = uuid.uuid4().hex  # inherited by the local workers `coordinator serve` starts
    server = subprocess.Popen([sys.executable, "-m", "coordinator", "serve", "--port", "0", "--target-model", MODEL,
                               "--draft-model", "tiny-random-qwen2-b", "--dtype", "float64", "--device", "cpu"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "SERVE_TEST_MARK": mark})
    try:
        line = server.stdout.readline()
        assert line.startswith("LISTENING http://"), line
        url = line.split()[1]
        reply = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                           "temperature": 0}, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        assert json.loads(httpx.get(url + "/v1/models").text)["data"][0]["id"] == MODEL
        assert len(processes_with("SERVE_TEST_MARK", mark)) >= 3  # the server, its verifier and its drafter
    finally:
        server.terminate()
        server.wait(30)
    # SIGTERM drains the server and stops the workers it started: nothing is left running.
    assert server.returncode == 0
    assert processes_with("SERVE_TEST_MARK", mark) == []


def test_prometheus_metrics_are_scraped(client, coordinator, tiny_target):
    from specmesh.ops.metrics import serve_metrics
    port = serve_metrics(0)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    # Counters are per process and other tests may not have run in this one (pytest-xdist): a generation whose drafts
    # are certainly accepted (the target drafting for itself) makes the acceptance metrics this test's own.
    with run_drafter(tiny_target, port=0) as identical, \
            Coordinator(coordinator.verifiers.targets[0], identical.address, tokenizer=tiny_target.tokenizer) as own:
        own.generate(PROMPT, GenerationOptions(max_new_tokens=12, draft_policy="heuristic"))
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values["specmesh_generated_tokens_total"] >= 12
    assert values["specmesh_drafted_tokens_total"] >= values["specmesh_accepted_tokens_total"] > 0
    assert 0 < values["specmesh_acceptance_rate"] <= 1 and values["specmesh_mean_acceptance_length"] >= 1
    assert values['specmesh_accepted_tokens_per_position_total{position="0"}'] > 0
    assert values['specmesh_rpc_requests_total{code="OK",method="Verify",service="verifier"}'] > 0
    assert values['specmesh_rpc_requests_total{code="OK",method="Propose",service="drafter"}'] > 0
    assert 'specmesh_rpc_latency_seconds_bucket{le="0.005",method="Verify",service="verifier"}' in values
    assert any(k.startswith("specmesh_breaker_state{") for k in values)
    assert any(k.startswith("specmesh_active_sessions{") for k in values)
    assert any(k.startswith("specmesh_kv_cache_bytes{") for k in values)
    assert "specmesh_failovers_total" in values and "specmesh_retries_total" in values


def test_the_servers_stream_guess_setting_reaches_every_generations_options():
    """`coordinator serve --no-stream-guesses` (create_app's stream_guesses) holds for every request's generation."""
    from types import SimpleNamespace
    from coordinator.serving.http_api import CompletionRequest
    fake = SimpleNamespace(verifier_info=SimpleNamespace(model_name="m"))
    body = CompletionRequest(model="m", prompt="hi")
    for setting in (True, False):
        api = create_app(fake, stream_guesses=setting).state.completions
        try:
            assert api.options_for(body, 8, chat=False, index=0).stream_guesses is setting
        finally:
            api.executor.shutdown()
    assert create_app(fake).state.completions.stream_guesses is True  # guesses are the default, as in generate

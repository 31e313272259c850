"""OpenAI-compatible HTTP API in front of a Coordinator (FastAPI): /v1/completions, /v1/chat/completions (both also
streaming as server-sent events), /v1/models and /health. Generations run in worker threads, so concurrent requests
are served concurrently; each is one session on the verifier fleet."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from coordinator.api import Coordinator, GenerationFailed, GenerationOptions, GenerationResult
from coordinator.draft_length import DEFAULT_POLICY

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "error": "error"}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # vLLM's extension
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


def create_app(coordinator: Coordinator, default_max_tokens: int = 256, draft_tokens: int | None = None,
               draft_policy: str = DEFAULT_POLICY, pipeline: bool = False) -> FastAPI:
    app = FastAPI(title="specmesh", description="OpenAI-compatible API over distributed speculative decoding")
    model_name = coordinator.verifier_info.model_name
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(400, f"{param or 'request'}: {first.get('msg', 'invalid request')}", param=param)

    @app.get("/health")
    async def health() -> JSONResponse:
        serving = [e.address for e in coordinator.verifiers.endpoints if e.serving]
        return JSONResponse(status_code=200 if serving else 503,
                            content={"status": "ok" if serving else "unavailable", "verifiers_serving": serving})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "specmesh"}]}

    def options_for(body: _Common, max_tokens: int | None, chat: bool, index: int) -> GenerationOptions:
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        seed = None if body.seed is None else (body.seed + index) % 2**64  # n > 1: distinct, reproducible seeds
        return GenerationOptions(max_new_tokens=max_tokens or default_max_tokens, draft_tokens=draft_tokens,
                                 draft_policy=draft_policy, pipeline=pipeline,
                                 temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=seed,
                                 stop=stop, chat=chat)

    def check_model(body: _Common) -> JSONResponse | None:
        if body.model != model_name:
            return error(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`.",
                         param="model", code="model_not_found")
        return None

    async def run(prompt_ids: list[int], body: _Common, max_tokens: int | None, kind: str) -> Any:
        if (bad := check_model(body)) is not None:
            return bad
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            choices = [options_for(body, max_tokens, kind == "chat", i) for i in range(body.n)]
            for options in choices:  # within the workers' limits (draft length, context): else 400, before streaming
                coordinator.check(len(prompt_ids), options)
        except ValueError as e:
            return error(400, str(e))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(prompt_ids, choices, request_id, kind, include_usage),
                                     media_type="text/event-stream")
        results: list[GenerationResult] = []
        for options in choices:
            try:
                results.append(await run_in_threadpool(coordinator.generate, list(prompt_ids), options))
            except GenerationFailed as e:
                return error(503, str(e), kind="service_unavailable_error", code="generation_failed")
        completion_tokens = sum(len(r.token_ids) for r in results)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                 "total_tokens": len(prompt_ids) + completion_tokens}
        if kind == "chat":
            return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                    "choices": [{"index": i, "message": {"role": "assistant", "content": r.text},
                                 "finish_reason": FINISH[r.finish_reason], "logprobs": None}
                                for i, r in enumerate(results)], "usage": usage}
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": i, "text": r.text, "finish_reason": FINISH[r.finish_reason], "logprobs": None}
                            for i, r in enumerate(results)], "usage": usage}

    async def stream(prompt_ids: list[int], choices: list[GenerationOptions], request_id: str, kind: str,
                     include_usage: bool) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        object_name = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(index: int, text: str | None, finish: str | None, first: bool = False) -> str:
            if kind == "chat":
                delta: dict = {"role": "assistant"} if first else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
            return "data: " + json.dumps({"id": request_id, "object": object_name, "created": int(time.time()),
                                          "model": model_name, "choices": [choice]}) + "\n\n"

        def produce() -> None:
            # Runs in a thread: pieces of text cross over to the event loop as they are accepted.
            for index, options in enumerate(choices):
                put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)  # noqa: E731
                try:
                    result = coordinator.generate(list(prompt_ids), options,
                                                  on_text=lambda text, i=index: put(("text", i, text)))
                    put(("done", index, result))
                except GenerationFailed as e:
                    put(("failed", index, e))
                    return
            put(("end", None, None))

        threading.Thread(target=produce, daemon=True, name=f"stream-{request_id[-8:]}").start()
        completion_tokens = 0
        if kind == "chat":
            yield chunk(0, "", None, first=True)
        while True:
            what, index, payload = await queue.get()
            if what == "text":
                yield chunk(index, payload, None)
            elif what == "done":
                completion_tokens += len(payload.token_ids)
                yield chunk(index, None if kind == "chat" else "", FINISH[payload.finish_reason])
                if kind == "chat" and index + 1 < len(choices):
                    yield chunk(index + 1, "", None, first=True)
            elif what == "failed":
                yield "data: " + json.dumps({"error": {"message": str(payload), "type": "service_unavailable_error",
                                                       "param": None, "code": "generation_failed"}}) + "\n\n"
                break
            else:
                break
        if include_usage:
            yield "data: " + json.dumps({"id": request_id, "object": object_name, "created": int(time.time()),
                                         "model": model_name, "choices": [], "usage": {
                                             "prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                                             "total_tokens": len(prompt_ids) + completion_tokens}}) + "\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            return error(400, "exactly one prompt per request is supported", param="prompt")
        if not prompts[0]:
            return error(400, "the prompt is empty", param="prompt")
        return await run(coordinator.encode_prompt(prompts[0], chat=False), body, body.max_tokens, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest) -> Any:
        messages = [m.model_dump() for m in body.messages]
        return await run(coordinator.encode_messages(messages), body, body.max_completion_tokens or body.max_tokens,
                         "chat")

    return app

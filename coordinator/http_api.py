"""OpenAI-compatible HTTP API in front of a Coordinator (FastAPI): /v1/completions, /v1/chat/completions (both also
streaming as server-sent events), /v1/models and /health. Generations run in worker threads, so concurrent requests
are served concurrently; each is one session on the verifier fleet."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, field_validator
from starlette.concurrency import run_in_threadpool

from coordinator.api import Coordinator, GenerationFailed, GenerationOptions, GenerationResult
from coordinator.draft_length import DEFAULT_POLICY

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "error": "error"}


def unicode_text(text: str | list[str]) -> str | list[str]:
    """JSON escapes can spell lone surrogates (\\ud800), which no tokenizer encodes: refuse them as bad input."""
    for piece in [text] if isinstance(text, str) else text:
        try:
            piece.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"not valid Unicode text: {e.reason} at position {e.start}") from None
    return text


INT32_MAX = 2**31 - 1  # top_k travels to the workers as an int32


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, le=INT32_MAX)  # vLLM's extension
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]

    _unicode_prompt = field_validator("prompt")(unicode_text)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str

    _unicode_content = field_validator("content")(unicode_text)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that fails validation: OpenAI's 400 invalid_request_error naming the first bad field."""
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return error(400, f"{param or 'request'}: {first.get('msg', 'invalid request')}", param=param)


class BodyTooLarge(HTTPException):
    """Raised while a route reads a body past the limit; FastAPI passes HTTPExceptions on to their handler."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body exceeds {max_bytes} bytes")


async def body_too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
    return error(413, exc.detail, code="request_too_large")


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 as soon as that many bytes arrived, declared
    (Content-Length) or streamed (chunked); uvicorn itself reads bodies of any size into memory."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            response = await body_too_large(None, BodyTooLarge(self.max_bytes))
            return await response(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted_receive, send)


def event(payload: dict) -> str:
    """One server-sent event."""
    return "data: " + json.dumps(payload) + "\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class Reply:
    """The shape of one request's response: a chat or a text completion, under one id, for one model."""

    chat: bool
    model: str
    request_id: str

    @classmethod
    def new(cls, chat: bool, model: str) -> "Reply":
        return cls(chat, model, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}")

    def completion(self, results: list[GenerationResult], prompt_tokens: int) -> dict:
        """The whole (non-streamed) response."""
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": r.text},
                        "finish_reason": FINISH[r.finish_reason], "logprobs": None} for i, r in enumerate(results)]
        else:
            choices = [{"index": i, "text": r.text, "finish_reason": FINISH[r.finish_reason], "logprobs": None}
                       for i, r in enumerate(results)]
        return {"id": self.request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": choices,
                "usage": usage(prompt_tokens, sum(len(r.token_ids) for r in results))}

    def chunk(self, choices: list[dict], **extra) -> str:
        return event({"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                      "created": int(time.time()), "model": self.model, "choices": choices, **extra})

    def text_chunk(self, index: int, text: str | None, finish: str | None, first: bool = False) -> str:
        """A piece of choice `index` (chat: a delta, opened by the assistant role), or its end with `finish`."""
        if self.chat:
            delta: dict = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            return self.chunk([{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}])
        return self.chunk([{"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}])


def generate_into(coordinator: Coordinator, prompt_ids: list[int], choices: list[GenerationOptions],
                  put: Callable[[tuple], None]) -> None:
    """Run the generations one after the other (in a thread), handing ("text", index, text), ("done", index, result),
    ("failed", index, error) and finally ("end", None, None) to `put` as they happen; a failure ends the stream."""
    for index, options in enumerate(choices):
        try:
            result = coordinator.generate(list(prompt_ids), options,
                                          on_text=lambda text, i=index: put(("text", i, text)))
            put(("done", index, result))
        except GenerationFailed as e:
            put(("failed", index, e))
            return
    put(("end", None, None))


async def stream_events(coordinator: Coordinator, prompt_ids: list[int], choices: list[GenerationOptions],
                        reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed response, as the generations accept text."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    # Pieces of text cross over from the generating thread to the event loop as they are accepted.
    put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)  # noqa: E731
    threading.Thread(target=generate_into, args=(coordinator, prompt_ids, choices, put), daemon=True,
                     name=f"stream-{reply.request_id[-8:]}").start()
    completion_tokens = 0
    if reply.chat:
        yield reply.text_chunk(0, "", None, first=True)
    while True:
        what, index, payload = await queue.get()
        if what == "text":
            yield reply.text_chunk(index, payload, None)
        elif what == "done":
            completion_tokens += len(payload.token_ids)
            yield reply.text_chunk(index, None if reply.chat else "", FINISH[payload.finish_reason])
            if reply.chat and index + 1 < len(choices):
                yield reply.text_chunk(index + 1, "", None, first=True)
        elif what == "failed":
            yield event({"error": {"message": str(payload), "type": "service_unavailable_error", "param": None,
                                   "code": "generation_failed"}})
            break
        else:
            break
    if include_usage:
        yield reply.chunk([], usage=usage(len(prompt_ids), completion_tokens))
    yield "data: [DONE]\n\n"


class CompletionsAPI:
    """The route handlers over one Coordinator, with the server's defaults for what a request does not say."""

    def __init__(self, coordinator: Coordinator, default_max_tokens: int, draft_tokens: int | None,
                 draft_policy: str, pipeline: bool) -> None:
        self.coordinator = coordinator
        self.default_max_tokens, self.draft_tokens = default_max_tokens, draft_tokens
        self.draft_policy, self.pipeline = draft_policy, pipeline
        self.model_name = coordinator.verifier_info.model_name
        self.created = int(time.time())

    async def health(self) -> JSONResponse:
        serving = [e.address for e in self.coordinator.verifiers.endpoints if e.serving]
        return JSONResponse(status_code=200 if serving else 503,
                            content={"status": "ok" if serving else "unavailable", "verifiers_serving": serving})

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specmesh"}]}

    async def completions(self, body: CompletionRequest) -> Any:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            return error(400, "exactly one prompt per request is supported", param="prompt")
        if not prompts[0]:
            return error(400, "the prompt is empty", param="prompt")
        return await self.respond(self.coordinator.encode_prompt(prompts[0], chat=False), body, body.max_tokens,
                                  chat=False)

    async def chat_completions(self, body: ChatRequest) -> Any:
        messages = [m.model_dump() for m in body.messages]
        return await self.respond(self.coordinator.encode_messages(messages), body,
                                  body.max_completion_tokens or body.max_tokens, chat=True)

    def options_for(self, body: _Common, max_tokens: int | None, chat: bool, index: int) -> GenerationOptions:
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        seed = None if body.seed is None else (body.seed + index) % 2**64  # n > 1: distinct, reproducible seeds
        return GenerationOptions(max_new_tokens=max_tokens or self.default_max_tokens, draft_tokens=self.draft_tokens,
                                 draft_policy=self.draft_policy, pipeline=self.pipeline,
                                 temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=seed,
                                 stop=stop, chat=chat)

    def request_options(self, prompt_ids: list[int], body: _Common, max_tokens: int | None,
                        chat: bool) -> list[GenerationOptions] | JSONResponse:
        """One GenerationOptions per choice (n), each within the workers' limits (draft length, context); or the
        error response (404 for another model, 400 for what the workers would refuse), before anything streams."""
        if body.model != self.model_name:
            return error(404, f"The model `{body.model}` does not exist; this server serves `{self.model_name}`.",
                         param="model", code="model_not_found")
        try:
            choices = [self.options_for(body, max_tokens, chat, i) for i in range(body.n)]
            for options in choices:
                self.coordinator.check(len(prompt_ids), options)
        except ValueError as e:
            return error(400, str(e))
        return choices

    async def respond(self, prompt_ids: list[int], body: _Common, max_tokens: int | None, chat: bool) -> Any:
        choices = self.request_options(prompt_ids, body, max_tokens, chat)
        if isinstance(choices, JSONResponse):
            return choices
        reply = Reply.new(chat, self.model_name)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_events(self.coordinator, prompt_ids, choices, reply, include_usage),
                                     media_type="text/event-stream")
        results: list[GenerationResult] = []
        for options in choices:
            try:
                results.append(await run_in_threadpool(self.coordinator.generate, list(prompt_ids), options))
            except GenerationFailed as e:
                return error(503, str(e), kind="service_unavailable_error", code="generation_failed")
        return reply.completion(results, len(prompt_ids))


def create_app(coordinator: Coordinator, default_max_tokens: int = 256, draft_tokens: int | None = None,
               draft_policy: str = DEFAULT_POLICY, pipeline: bool = False,
               max_body_bytes: int = 1024 * 1024) -> FastAPI:
    api = CompletionsAPI(coordinator, default_max_tokens, draft_tokens, draft_policy, pipeline)
    app = FastAPI(title="specmesh", description="OpenAI-compatible API over distributed speculative decoding")
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(BodyTooLarge, body_too_large)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    return app

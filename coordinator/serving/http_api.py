"""OpenAI-compatible HTTP API in front of a Coordinator (FastAPI): /v1/completions, /v1/chat/completions (both also
streaming as server-sent events), /v1/models and /health. Generations run in worker threads, so concurrent requests
are served concurrently; each is one session on the verifier fleet.

Every error is answered in OpenAI's shape ({"error": {"message", "type", "param", "code"}}), and whatever of the
request an error message echoes goes through `printable` (specmesh/wire/printable.py): a lone surrogate, a control
character or a megabyte string in any field gets a 4xx with a short, valid UTF-8 message, never a 500. `LastResort`
answers anything that still escapes (a bug) in the same shape.

Admission (coordinator/serving/admission.py) bounds the generations running and the requests waiting for one; the rest are
refused at once (429, Retry-After). A client that disconnects cancels its generation (coordinator/cancel.py): the
RPCs in flight are cancelled and the workers' sessions ended, so nothing more is computed for it."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.serving.admission import RETRY_AFTER_S, Admission, AdmissionConfig, Refused
from coordinator.api import Coordinator, GenerationFailed, GenerationOptions, GenerationResult
from coordinator.cancel import CancelToken, GenerationCancelled
from coordinator.drafting.policies import DEFAULT_POLICY
from coordinator.stream_flush import DEFAULT_STREAM_FLUSH_S
from specmesh.wire.printable import printable

log = logging.getLogger("specmesh.http")

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "error": "error"}


def unicode_text(text: str | list[str] | None) -> str | list[str] | None:
    """JSON escapes (and raw bytes that Python's JSON decoder lets through) can spell lone surrogates (\\ud800), which
    no tokenizer encodes: refuse them as bad input."""
    for piece in [] if text is None else [text] if isinstance(text, str) else text:
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

    _unicode_stop = field_validator("stop")(unicode_text)  # matched against generated text, and recorded


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


MESSAGE_LIMIT = 1000  # characters of an error message, whatever of the request it quotes
PARAM_LIMIT = 200


def _printable_tree(value: Any) -> Any:
    """A JSON-able value with every string (and key) printable and every float finite."""
    if isinstance(value, dict):
        return {printable(k, PARAM_LIMIT): _printable_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_printable_tree(v) for v in value]
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    return printable(value, 10 * MESSAGE_LIMIT)


class SafeJSONResponse(JSONResponse):
    """A JSON response that always renders: should a value hold text UTF-8 cannot encode (a lone surrogate) or
    anything else JSON cannot hold, it is sent in printable form instead of failing the response (a 500)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except (TypeError, ValueError):  # UnicodeEncodeError is a ValueError; so is a NaN
            return json.dumps(_printable_tree(content), ensure_ascii=True, allow_nan=False,
                              separators=(",", ":")).encode("ascii")


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape. The message and param may quote the request: both are made printable (valid UTF-8, no
    control characters, bounded length) here, whoever built them."""
    return SafeJSONResponse(status_code=status, headers=headers, content={"error": {
        "message": printable(message, MESSAGE_LIMIT), "type": kind,
        "param": None if param is None else printable(param, PARAM_LIMIT), "code": code}})


def refusal(refused: Refused) -> JSONResponse:
    """429 (at capacity) or 503 (shutting down), both saying when to try again."""
    kind = "rate_limit_error" if refused.status == 429 else "service_unavailable_error"
    return error(refused.status, str(refused), kind=kind, code=refused.code,
                 headers={"Retry-After": str(RETRY_AFTER_S)})


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that fails validation: OpenAI's 400 invalid_request_error naming the first bad field."""
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(printable(p, 60) for p in first.get("loc", ())[1:]) or None
    return error(400, f"{param or 'request'}: {printable(first.get('msg', 'invalid request'))}", param=param)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors in OpenAI's shape: 404 for an unknown route, 405 for a wrong method, 400
    for a JSON body that is not even text (invalid UTF-8)."""
    message = str(exc.detail)
    if exc.status_code in (404, 405):
        message = f"{message}: {printable(request.method, 20)} {printable(request.url.path)}"
    return error(exc.status_code, message, kind="invalid_request_error" if exc.status_code < 500 else "server_error",
                 headers=exc.headers)


class LastResort:
    """ASGI middleware, outermost: an exception that escapes everything else before a response has started (a bug,
    or an error response that could not be built) is still answered in OpenAI's shape with a printable message: 400
    for text that is not valid Unicode (only a request brings that), 500 otherwise. After the response has started
    there is nothing left to answer with: the exception goes on to the server."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as e:
            if started:
                raise
            where = f"{printable(scope.get('method'), 20)} {printable(scope.get('path'))}"
            if isinstance(e, UnicodeError):
                log.warning("%s: text that is not valid Unicode: %s", where, printable(e))
                response = error(400, "the request holds text that is not valid Unicode", code="invalid_unicode")
            else:
                # Where it happened, and what it says: the message may quote the request, so printable and bounded.
                trace = printable("".join(traceback.format_tb(e.__traceback__)), 20_000, newlines=True)
                log.error("%s: unhandled %s: %s\n%s", where, type(e).__name__, printable(e, MESSAGE_LIMIT), trace)
                response = error(500, f"the server failed on this request ({type(e).__name__}); it keeps serving",
                                 kind="server_error", code="internal_error")
            await response(scope, receive, send)


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


FINAL_EVENTS = ("end", "failed", "cancelled")


def generate_into(coordinator: Coordinator, prompt_ids: list[int], choices: list[GenerationOptions],
                  put: Callable[[tuple], None], cancel: CancelToken) -> None:
    """Run the generations one after the other (in a thread), handing ("text", index, text), ("done", index, result),
    ("failed", index, error), ("cancelled", index, error) and finally ("end", None, None) to `put` as they happen; a
    failure or a cancel ends the stream."""
    for index, options in enumerate(choices):
        try:
            result = coordinator.generate(list(prompt_ids), options,
                                          on_text=lambda text, i=index: put(("text", i, text)), cancel=cancel)
            put(("done", index, result))
        except GenerationFailed as e:
            put(("failed", index, e))
            return
        except GenerationCancelled as e:
            put(("cancelled", index, e))
            return
    put(("end", None, None))


class Generation:
    """One request's generations, running in a worker thread; their events cross over to the event loop through
    `events` as they happen. `release` (the admission slot) is called on the event loop once the thread is done."""

    def __init__(self, coordinator: Coordinator, prompt_ids: list[int], choices: list[GenerationOptions],
                 cancel: CancelToken, executor: ThreadPoolExecutor, release: Callable[[], None]) -> None:
        self.cancel = cancel
        self.events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def put(item: tuple) -> None:
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, item)
            except RuntimeError:
                pass  # the event loop has closed (server stopped): nobody is listening

        def run() -> None:
            # The last event (end, failed, cancelled) is held back until the slot is released, both on the loop in
            # one callback: a client that has its answer finds the capacity it freed already free.
            last: list[tuple] = []

            def put_or_hold(item: tuple) -> None:
                (last.append if item[0] in FINAL_EVENTS else put)(item)

            def finish() -> None:
                release()
                for item in last:
                    self.events.put_nowait(item)
            try:
                generate_into(coordinator, prompt_ids, choices, put_or_hold, cancel)
            except Exception as e:  # a bug, not a worker fault: still answer the client, and say why
                log.exception("generation crashed")
                last[:] = [("failed", None, e)]
            finally:
                try:
                    loop.call_soon_threadsafe(finish)
                except RuntimeError:
                    pass
        executor.submit(run)


async def cancel_on_disconnect(request: Request, cancel: CancelToken) -> None:
    """Cancel when the client disconnects (its request body has been read: what arrives next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel.cancel("the client disconnected")


class GenerationStream(StreamingResponse):
    """A streamed response that cancels its generation whenever the response ends early: the client disconnected
    (Starlette stops the stream) or the server is stopping."""

    def __init__(self, content: AsyncIterator[str], cancel: CancelToken) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.cancel = cancel

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cancel.cancel("the client disconnected")  # a no-op once the generation has ended


def unavailable(e: Exception, code: str) -> dict:
    return {"error": {"message": printable(e, MESSAGE_LIMIT), "type": "service_unavailable_error", "param": None,
                      "code": code}}


async def stream_events(generation: Generation, prompt_tokens: int, n_choices: int, reply: Reply,
                        include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed response, as the generations accept text."""
    completion_tokens = 0
    if reply.chat:
        yield reply.text_chunk(0, "", None, first=True)
    while True:
        what, index, payload = await generation.events.get()
        if what == "text":
            yield reply.text_chunk(index, payload, None)
        elif what == "done":
            completion_tokens += len(payload.token_ids)
            yield reply.text_chunk(index, None if reply.chat else "", FINISH[payload.finish_reason])
            if reply.chat and index + 1 < n_choices:
                yield reply.text_chunk(index + 1, "", None, first=True)
        elif what in ("failed", "cancelled"):
            yield event(unavailable(payload, "generation_failed" if what == "failed" else "cancelled"))
            break
        else:
            break
    if include_usage:
        yield reply.chunk([], usage=usage(prompt_tokens, completion_tokens))
    yield "data: [DONE]\n\n"


class CompletionsAPI:
    """The route handlers over one Coordinator, with the server's defaults for what a request does not say."""

    def __init__(self, coordinator: Coordinator, default_max_tokens: int, draft_tokens: int | None,
                 draft_policy: str, pipeline: bool, admission: AdmissionConfig = AdmissionConfig(),
                 stream_flush_s: float = DEFAULT_STREAM_FLUSH_S, stream_guesses: bool = True) -> None:
        self.coordinator = coordinator
        self.admission = Admission(admission)
        # One thread per running generation: admission never lets more run, so nothing queues here unseen.
        self.executor = ThreadPoolExecutor(admission.max_active, thread_name_prefix="generate")
        self._running: set[CancelToken] = set()  # cancelled all at once when the server stops
        self._running_lock = threading.Lock()
        self.default_max_tokens, self.draft_tokens = default_max_tokens, draft_tokens
        self.draft_policy, self.pipeline, self.stream_flush_s = draft_policy, pipeline, stream_flush_s
        self.stream_guesses = stream_guesses
        self.model_name = coordinator.verifier_info.model_name
        self.created = int(time.time())

    async def health(self) -> JSONResponse:
        serving = [e.address for e in self.coordinator.verifiers.endpoints if e.serving]
        status = "draining" if self.admission.draining else "ok" if serving else "unavailable"
        return JSONResponse(status_code=200 if status == "ok" else 503,
                            content={"status": status, "verifiers_serving": serving,
                                     "requests_running": self.admission.active,
                                     "requests_waiting": self.admission.waiting})

    def cancel_all(self, reason: str) -> int:
        """Cancel every generation in progress (the server is stopping); how many there were. Any thread."""
        with self._running_lock:
            running = list(self._running)
        for cancel in running:
            cancel.cancel(reason)
        return len(running)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specmesh"}]}

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            return error(400, "exactly one prompt per request is supported", param="prompt")
        if not prompts[0]:
            return error(400, "the prompt is empty", param="prompt")
        # Tokenizing a long prompt takes a while: off the event loop, so other requests are not stalled meanwhile.
        prompt_ids = await asyncio.to_thread(self.coordinator.encode_prompt, prompts[0], chat=False)
        return await self.respond(request, prompt_ids, body, body.max_tokens, chat=False)

    async def chat_completions(self, body: ChatRequest, request: Request) -> Any:
        messages = [m.model_dump() for m in body.messages]
        prompt_ids = await asyncio.to_thread(self.coordinator.encode_messages, messages)
        return await self.respond(request, prompt_ids, body, body.max_completion_tokens or body.max_tokens, chat=True)

    def options_for(self, body: _Common, max_tokens: int | None, chat: bool, index: int) -> GenerationOptions:
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        seed = None if body.seed is None else (body.seed + index) % 2**64  # n > 1: distinct, reproducible seeds
        return GenerationOptions(max_new_tokens=max_tokens or self.default_max_tokens, draft_tokens=self.draft_tokens,
                                 draft_policy=self.draft_policy, pipeline=self.pipeline,
                                 temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=seed,
                                 stop=stop, chat=chat, stream_flush_s=self.stream_flush_s,
                                 stream_guesses=self.stream_guesses)

    def request_options(self, prompt_ids: list[int], body: _Common, max_tokens: int | None,
                        chat: bool) -> list[GenerationOptions] | JSONResponse:
        """One GenerationOptions per choice (n), each within the workers' limits (draft length, context); or the
        error response (404 for another model, 400 for what the workers would refuse), before anything streams."""
        if body.model != self.model_name:
            return error(404, f"The model `{printable(body.model, 100)}` does not exist; this server serves "
                         f"`{self.model_name}`.", param="model", code="model_not_found")
        try:
            choices = [self.options_for(body, max_tokens, chat, i) for i in range(body.n)]
            for options in choices:
                self.coordinator.check(len(prompt_ids), options)
        except ValueError as e:
            return error(400, printable(e, MESSAGE_LIMIT))
        return choices

    async def respond(self, request: Request, prompt_ids: list[int], body: _Common, max_tokens: int | None,
                      chat: bool) -> Any:
        choices = self.request_options(prompt_ids, body, max_tokens, chat)
        if isinstance(choices, JSONResponse):
            return choices
        cancel = CancelToken()
        watcher = asyncio.create_task(cancel_on_disconnect(request, cancel))
        try:
            try:
                release = await self.admission.enter()
            except Refused as refused:
                return refusal(refused)
            generation = self.start(prompt_ids, choices, cancel, release)
            reply = Reply.new(chat, self.model_name)
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                # From here Starlette watches for the disconnect, and the response cancels the generation.
                return GenerationStream(stream_events(generation, len(prompt_ids), len(choices), reply,
                                                      include_usage), cancel)
            return await self.collect(generation, reply, len(prompt_ids))
        finally:
            watcher.cancel()

    def start(self, prompt_ids: list[int], choices: list[GenerationOptions], cancel: CancelToken,
              release: Callable[[], None]) -> Generation:
        with self._running_lock:
            self._running.add(cancel)

        def finished() -> None:
            with self._running_lock:
                self._running.discard(cancel)
            release()
        return Generation(self.coordinator, prompt_ids, choices, cancel, self.executor, finished)

    async def collect(self, generation: Generation, reply: Reply, prompt_tokens: int) -> Any:
        """The whole (non-streamed) response, once every choice has been generated."""
        results: list[GenerationResult] = []
        while True:
            what, _, payload = await generation.events.get()
            if what == "done":
                results.append(payload)
            elif what in ("failed", "cancelled"):
                return SafeJSONResponse(status_code=503, content=unavailable(
                    payload, "generation_failed" if what == "failed" else "cancelled"))
            elif what == "end":
                return reply.completion(results, prompt_tokens)


def create_app(coordinator: Coordinator, default_max_tokens: int = 256, draft_tokens: int | None = None,
               draft_policy: str = DEFAULT_POLICY, pipeline: bool = False,
               admission: AdmissionConfig = AdmissionConfig(), max_body_bytes: int = 1024 * 1024,
               stream_flush_s: float = DEFAULT_STREAM_FLUSH_S, stream_guesses: bool = True) -> FastAPI:
    """The app; `app.state.completions` is its CompletionsAPI (admission, cancel_all) for the server around it."""
    api = CompletionsAPI(coordinator, default_max_tokens, draft_tokens, draft_policy, pipeline, admission,
                         stream_flush_s, stream_guesses)
    app = FastAPI(title="specmesh", description="OpenAI-compatible API over distributed speculative decoding",
                  default_response_class=SafeJSONResponse)
    app.state.completions = api
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(BodyTooLarge, body_too_large)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(LastResort)  # added last: the outermost of the two
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    return app

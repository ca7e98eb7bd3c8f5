"""An OpenAI-compatible HTTP server: real clients (curl, the openai package, chat UIs) on the engine.

    python -m minicb serve          # the embedded SmolLM2-135M-Instruct on http://127.0.0.1:8000
    curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi!"}], "stream": true}'

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both stream server-sent
events ending in `data: [DONE]` when "stream": true), GET /health, GET /metrics (Prometheus text).
/openapi.json documents every body, field and status (the models are in protocol.py).

Bad input is stopped at the edge, before it reaches the engine, because the engine's steps are
shared: one request that broke a step would fail every stream in flight. In order:
  1. a body over --max-request-bytes gets 413 before it is read whole (BodySizeLimit);
  2. JSON is parsed here: nesting deeper than MAX_JSON_DEPTH or a string that is not valid Unicode
     (a lone surrogate such as "\ud800") gets 400;
  3. the pydantic models check every field's type and range (400 naming the field, never 422);
  4. tokenization and chat templating run in a worker thread, so a huge prompt costs its own
     sender and nobody else: the event loop keeps serving other clients meanwhile;
  5. the engine refuses what only it can judge (prompt + max_tokens > max_model_len): 400.
A request that still fails inside a step is stopped alone (engine.py, Engine._fail) and its
client gets an error; everyone else keeps streaming. A full server answers 503 with Retry-After.
Every error body has OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..detokenizer import text_delta
from ..llm import chat_token_ids
from ..sampling_params import SamplingParams
from .engine_loop import AsyncEngine, QueueFullError, RequestStream
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       ErrorResponse, ModelList, SamplingFields)
from .validation import DEFAULT_MAX_REQUEST_BYTES, APIError, BodySizeLimit, CheckedJSONRoute, validation_error

ERROR_STATUSES = {400: "invalid input (OpenAI error shape, naming the field)", 404: "model not served here",
                  413: "body larger than --max-request-bytes", 500: "the request failed inside the engine",
                  503: "server full (Retry-After) or engine not running"}
ERRORS = {code: {"model": ErrorResponse, "description": why} for code, why in ERROR_STATUSES.items()}
STREAM = {"text/event-stream": {"schema": {  # one server-sent event
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk (a CompletionResponse, or a "
                            "ChatCompletionChunk), an error object, or `[DONE]`, the last event"},
                   "event": {"type": "string"}}}}}


def room_for_reply(engine, num_prompt_tokens: int) -> int:
    """Default max_tokens of a chat reply: whatever max_model_len and the KV cache leave."""
    c = engine.config
    room = min(c.max_model_len - num_prompt_tokens, c.num_blocks * c.block_size - num_prompt_tokens + 1)
    if room <= 0:
        raise APIError(400, f"prompt has {num_prompt_tokens} tokens, which leaves no room for a reply "
                       f"(max_model_len is {c.max_model_len})", "messages")
    return room


def to_sampling_params(body: SamplingFields, default_max_tokens: int) -> SamplingParams:
    try:
        return body.sampling_params(default_max_tokens)
    except ValueError as e:  # SamplingParams names the field: "top_p must be in (0, 1], got 2"
        raise APIError(400, str(e), str(e).split()[0]) from None


# ---------------------------------------------------------------------- response bodies
def choice(chat: bool, stream: bool, text: str, out, token_ids: list[int]) -> dict:
    """One entry of "choices": text (completions), message (chat) or delta (chat stream)."""
    if not chat:
        c = {"index": 0, "text": text}
    elif stream:
        c = {"index": 0, "delta": {"content": text} if text or not out.finished else {}}
    else:
        c = {"index": 0, "message": {"role": "assistant", "content": text}}
    return {**c, "logprobs": None, "finish_reason": out.outputs[0].finish_reason, "token_ids": token_ids}


def usage(out) -> dict:
    n_in, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def last_output(stream: RequestStream):
    out = None
    async for out in stream:
        pass
    return out


# ---------------------------------------------------------------------- the app
def build_app(async_engine: AsyncEngine, served_model_name: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    engine = async_engine.engine
    model_name = served_model_name or engine.model_name

    async def lifespan(app):
        async_engine.start(asyncio.get_running_loop())
        yield
        async_engine.stop()

    app = FastAPI(title="minicb", summary="OpenAI-compatible server of minicb, a continuous-batching engine",
                  lifespan=lifespan, strict_content_type=False)  # a body sent without Content-Type is read as JSON too
    app.router.route_class = CheckedJSONRoute
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)

    @app.exception_handler(HTTPException)  # APIError, unknown route, wrong method, 413: one error body
    async def http_error(request, e: HTTPException):
        if isinstance(e, APIError):
            return e.response()
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                        headers=e.headers).response()  # keeps Allow on a 405

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        return validation_error(e).response()

    @app.exception_handler(Exception)  # a bug answers 500 with a body; the server keeps serving
    async def internal_error(request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").response()

    @app.get("/health", responses={503: ERRORS[503]})
    async def health() -> dict[str, str]:
        if not async_engine.is_running:
            raise APIError(503, "the engine loop is not running", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}})
    async def metrics():
        return PlainTextResponse(async_engine.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "max_model_len": engine.config.max_model_len}]}

    def check_model(body: SamplingFields) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {model_name!r}",
                           "model", kind="not_found_error")

    def tokenize_prompt(prompt) -> list[int]:
        try:
            return engine.tokenize(prompt)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None

    def tokenize_chat(body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        tokenizer = engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model {engine.model_name!r} has no chat template: use /v1/completions", "messages")
        try:
            return chat_token_ids(tokenizer, messages)
        except Exception as e:  # templates may refuse some conversations (e.g. roles that do not alternate)
            raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={200: {"content": STREAM}, **ERRORS})
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        prompt_ids = await run_in_threadpool(tokenize_prompt, body.one_prompt())  # off the event loop
        return await generate(request, body, prompt_ids, to_sampling_params(body, 16), chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={200: {"content": STREAM}, **ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        prompt_ids = await run_in_threadpool(tokenize_chat, body)  # off the event loop
        params = to_sampling_params(body, room_for_reply(engine, len(prompt_ids)))
        return await generate(request, body, prompt_ids, params, chat=True)

    async def generate(request: Request, body: SamplingFields, prompt_ids: list[int], params: SamplingParams,
                       chat: bool):
        try:
            stream = await async_engine.submit(prompt_ids, params, body.priority)
        except ValueError as e:  # too long for max_model_len or the KV cache; a priority without the policy
            raise APIError(400, str(e)) from None
        except QueueFullError as e:
            raise APIError(503, str(e), kind="overloaded") from None
        except RuntimeError as e:  # the engine loop is not running
            raise APIError(503, str(e), kind="server_error") from None
        kind = ("chat.completion.chunk" if body.stream else "chat.completion") if chat else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{stream.request_id}", "object": kind,
                "created": int(time.time()), "model": model_name}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(sse(stream, head, chat, include_usage), media_type="text/event-stream")
        # Not streaming: wait for the last output, but abort if the client hangs up meanwhile.
        result = asyncio.ensure_future(last_output(stream))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not result.done():
            result.cancel()  # its `async for` ends with CancelledError, which aborts the request
            return JSONResponse({}, status_code=499)  # nobody is listening any more
        try:
            out = result.result()
        except RuntimeError as e:  # this request failed inside the engine
            raise APIError(500, str(e), kind="server_error") from None
        sample = out.outputs[0]
        return {**head, "choices": [choice(chat, False, sample.text, out, sample.token_ids)], "usage": usage(out)}

    async def sse(stream: RequestStream, head: dict, chat: bool, include_usage: bool):
        event = lambda payload: f"data: {json.dumps(payload)}\n\n"
        if chat:  # OpenAI opens a chat stream with the role
            yield event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]})
        sent, out = "", None
        try:
            async for out in stream:
                delta = text_delta(sent, out.outputs[0].text, out.finished)
                sent += delta
                yield event({**head, "choices": [choice(chat, True, delta, out, out.outputs[0].new_token_ids)]})
        except RuntimeError as e:  # this request failed inside the engine: tell the client in the stream
            yield event({"error": {"message": str(e), "type": "server_error", "param": None, "code": 500}})
            out = None
        finally:  # the client hung up (this generator was cancelled or closed): free its blocks now
            stream.abort()
        if include_usage and out is not None:
            yield event({**head, "choices": [], "usage": usage(out)})
        yield "data: [DONE]\n\n"

    return app



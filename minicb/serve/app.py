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
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from .async_engine import AsyncEngine, QueueFullError, RequestStream
from .engine import chat_token_ids
from .protocol import (UNSUPPORTED, ChatCompletionRequest, ChatCompletionResponse,
                       CompletionRequest, CompletionResponse, ErrorResponse, ModelList, SamplingFields)
from .sampling_params import SamplingParams

MAX_JSON_DEPTH = 16  # the deepest real body (chat content parts) is 5 levels
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # ~1M tokens of text: far beyond any prompt a model here can take
ERROR_STATUSES = {400: "invalid input (OpenAI error shape, naming the field)", 404: "model not served here",
                  413: "body larger than --max-request-bytes", 500: "the request failed inside the engine",
                  503: "server full (Retry-After) or engine not running"}
ERRORS = {code: {"model": ErrorResponse, "description": why} for code, why in ERROR_STATUSES.items()}
STREAM = {"text/event-stream": {"schema": {  # one server-sent event
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk (a CompletionResponse, or a "
                            "ChatCompletionChunk), an error object, or `[DONE]`, the last event"},
                   "event": {"type": "string"}}}}}


class APIError(HTTPException):
    """An error a client should see, in OpenAI's shape. An HTTPException, so that FastAPI passes it
    through untouched even when it is raised while the body is being parsed."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(status, message, headers)
        self.message, self.param, self.kind = message, param, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status_code}}
        headers = dict(self.headers or {})
        if self.status_code == 503:
            headers["Retry-After"] = "1"
        return JSONResponse(body, status_code=self.status_code, headers=headers or None)


# ---------------------------------------------------------------------- parsing and validation
def check_json(value, depth: int = 1, field: str | None = None) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings that are not valid Unicode.
    `field`: the top-level field being checked, named in the error."""
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"JSON is nested more than {MAX_JSON_DEPTH} levels deep", field)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, which JSON's \\uXXXX escapes can spell
            raise APIError(400, f"'{field or 'body'}' is not valid Unicode: {e.reason} at position {e.start}",
                           field) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_json(k, depth + 1, field)
            check_json(v, depth + 1, k if depth == 1 else field)
    elif isinstance(value, list):
        for v in value:
            check_json(v, depth + 1, field)


class BodySizeLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, before it is read whole. A declared
    Content-Length over the limit is answered at once, without reading a byte; a body sent in chunks
    is cut off as soon as the bytes received pass the limit (the handler's read raises APIError).
    (FastAPI's own max_body_size does the same, but answers in plain text, not OpenAI's shape.)"""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"request body is larger than {self.max_bytes} bytes (--max-request-bytes)")
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await too_large.response()(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise too_large
            return message

        await self.app(scope, counted, send)


class CheckedJSONRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            try:
                body = json.loads(await self.body())
            except RecursionError:  # Python's parser gives up near 1,000 levels
                raise APIError(400, f"JSON is nested more than {MAX_JSON_DEPTH} levels deep") from None
            check_json(body)
            self._json = body
        return self._json


class CheckedJSONRoute(APIRoute):
    """A route whose body goes through CheckedJSONRequest.json() before FastAPI validates it."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            return await handler(CheckedJSONRequest(request.scope, request.receive))

        return checked


TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none", "constrained", "literal", "function")
PROMPT_FORMS = "a non-empty string, a list of integer token ids, or a list holding one of those (one prompt)"


def validation_error(e: RequestValidationError) -> APIError:
    """FastAPI's 422 becomes OpenAI's 400, naming the first field at fault."""
    err = e.errors()[0]
    # pydantic puts union members' type names in the location ("prompt", "str"): keep field names only
    loc = [f"[{x}]" if isinstance(x, int) else x for x in err.get("loc", ())
           if x != "body" and not (isinstance(x, str) and x.split("-")[0].split("[")[0] in TYPE_TAGS)]
    field = loc[0] if loc else None
    if err.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if not loc and err.get("type") in ("model_attributes_type", "dict_type"):
        return APIError(400, "request body must be a JSON object (Content-Type: application/json)")
    neutral = UNSUPPORTED.get(field)
    if neutral is not None and not err["type"].endswith("_type"):  # right type, a value minicb lacks
        return APIError(400, f"'{field}' is not supported by minicb (only {neutral})", field)
    if field == "prompt" and err["type"] != "missing":
        return APIError(400, f"'prompt' must be {PROMPT_FORMS}", "prompt")
    got = json.dumps(err.get("input"))[:50] if err.get("input") is not None else "nothing"
    path = "".join(x if x.startswith("[") or i == 0 else f".{x}" for i, x in enumerate(loc)) or "body"
    if err["type"] == "missing":
        return APIError(400, f"'{path}' is required", field)
    return APIError(400, f"'{path}': {err['msg']} (got {got})", field)


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
def text_delta(sent: str, text: str, finished: bool) -> str:
    """New text since `sent`. A trailing U+FFFD is half of a multi-byte character: hold it back."""
    if not finished:
        text = text.rstrip("\ufffd")
    return text[len(sent):] if text.startswith(sent) else ""


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


# ---------------------------------------------------------------------- running it
class ServerThread:
    """uvicorn in a background thread on a free loopback port: `with ServerThread(app) as url: ...`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        # Let uvicorn bind (port 0: any free port). A socket made by socket.create_server has proto 0,
        # and asyncio then skips TCP_NODELAY: every response would wait ~40 ms for a delayed ACK.
        self.host = host
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="minicb-uvicorn", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.host}:{port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(15)


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="model dir or hub id (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None, help="name in /v1/models (default: the model's)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-waiting", type=int, default=64,
                        help="requests held beyond max_num_seqs before new ones get 503 (default 64)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"larger request bodies get 413 before they are read (default {DEFAULT_MAX_REQUEST_BYTES})")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once (batch slots)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256, help="token budget of one step")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from a 512 MiB budget)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trace-steps", type=int, default=1000, help="engine steps kept in the trace")


def main(args) -> None:
    from .config import EngineConfig
    from .engine import Engine

    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                          num_blocks=args.num_blocks, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = Engine(config)
    app = build_app(AsyncEngine(engine, args.max_waiting, args.trace_steps), args.served_model_name,
                    args.max_request_bytes)
    print(f"minicb: serving {args.served_model_name or engine.model_name} on http://{args.host}:{args.port}/v1 "
          f"({engine.config.num_blocks} KV blocks of {engine.config.block_size}, "
          f"{engine.config.max_num_seqs} slots, max_waiting={args.max_waiting})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)

"""An OpenAI-compatible HTTP server: real clients (curl, the openai package, chat UIs) on the engine.

    python -m minicb serve          # the embedded SmolLM2-135M-Instruct on http://127.0.0.1:8000
    curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi!"}], "stream": true}'

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both stream server-sent
events ending in `data: [DONE]` when "stream": true), GET /health, GET /metrics (Prometheus).
Every request is checked here (JSON, field types, sampling parameters, prompt length) and a bad
one is answered 400 with an OpenAI-style error body before it reaches the engine; a full waiting
queue answers 503. Accepted requests all go to the one engine loop (async_engine.py), so
concurrent clients share decode steps: continuous batching, live.
Extensions beyond the OpenAI API: prompts as token-id lists (for models without a tokenizer),
`top_k`, `ignore_eos`, `stop_token_ids`, and `token_ids` (the generated ids) in every choice.
"""

import asyncio
import json
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .async_engine import AsyncEngine, QueueFullError, RequestStream
from .sampling_params import SamplingParams

# OpenAI fields minicb does not implement: accepted only with their neutral value.
UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": False, "top_logprobs": 0, "suffix": None,
               "presence_penalty": 0, "frequency_penalty": 0, "stop": None, "tools": None, "logit_bias": None}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


# ---------------------------------------------------------------------- request validation
def field(body: dict, name: str, kinds: tuple, default=None):
    """body[name] checked against JSON types (a bool is never a number here); missing/null -> default."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        what = "a number" if float in kinds else {int: "an integer", str: "a string", bool: "a boolean",
                                                  list: "an array", dict: "an object"}[kinds[0]]
        raise APIError(400, f"'{name}' must be {what}, got {json.dumps(value)[:50]}", name)
    return value


def sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) not in (None, neutral, [], {}):
            raise APIError(400, f"'{name}' is not supported by minicb (only {json.dumps(neutral)})", name)
    max_tokens = field(body, "max_completion_tokens", (int,))  # the chat API's newer name
    if max_tokens is None:
        max_tokens = field(body, "max_tokens", (int,), default_max_tokens)
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=field(body, "temperature", (int, float), 1.0),
                              top_p=field(body, "top_p", (int, float), 1.0), top_k=field(body, "top_k", (int,), 0),
                              seed=field(body, "seed", (int,)), ignore_eos=field(body, "ignore_eos", (bool,), False),
                              stop_token_ids=field(body, "stop_token_ids", (list,)))
    except ValueError as e:  # SamplingParams names the field: "top_p must be in (0, 1], got 2"
        raise APIError(400, str(e), str(e).split()[0]) from None


def completion_prompt(body: dict, engine) -> list[int]:
    """`prompt` as text, as token ids, or as a list holding one of those (one prompt per request)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "'prompt' is required (a string or a list of token ids)", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if not isinstance(prompt, (str, list)) or isinstance(prompt, list) and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise APIError(400, "'prompt' must be a string or a list of integer token ids (one prompt per request)",
                       "prompt")
    if not prompt:
        raise APIError(400, "'prompt' is empty: at least one token is needed", "prompt")
    try:
        return engine.tokenize(prompt)
    except ValueError as e:
        raise APIError(400, str(e), "prompt") from None


def chat_prompt(body: dict, engine) -> list[int]:
    """`messages` rendered by the tokenizer's chat template, ending where the assistant replies."""
    messages = field(body, "messages", (list,))
    if not messages:
        raise APIError(400, "'messages' is required: a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        clean.append({"role": m["role"], "content": content})
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"model {engine.model_name!r} has no chat template: use /v1/completions", "messages")
    try:
        return list(tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    except Exception as e:  # templates may refuse some conversations (e.g. roles that do not alternate)
        raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None


def room_for_reply(engine, num_prompt_tokens: int) -> int:
    """Default max_tokens of a chat reply: whatever max_model_len and the KV cache leave."""
    c = engine.config
    room = min(c.max_model_len - num_prompt_tokens, c.num_blocks * c.block_size - num_prompt_tokens + 1)
    if room <= 0:
        raise APIError(400, f"prompt has {num_prompt_tokens} tokens, which leaves no room for a reply "
                       f"(max_model_len is {c.max_model_len})", "messages")
    return room


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
def build_app(async_engine: AsyncEngine, served_model_name: str | None = None) -> FastAPI:
    engine = async_engine.engine
    model_name = served_model_name or engine.model_name

    async def lifespan(app):
        async_engine.start(asyncio.get_running_loop())
        yield
        async_engine.stop()

    app = FastAPI(title="minicb", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)  # unknown route, wrong method: same error body
    async def http_error(request, e: HTTPException):
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").response()

    @app.exception_handler(Exception)  # a bug answers 500 with a body; the server keeps serving
    async def internal_error(request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").response()

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            raise APIError(503, "the engine loop is not running", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(async_engine.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "minicb",
                "max_model_len": engine.config.max_model_len}
        return {"object": "list", "data": [card]}

    async def parse(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        requested = field(body, "model", (str,))
        if requested is not None and requested != model_name:
            raise APIError(404, f"model {requested!r} is not served here; this server serves {model_name!r}",
                           "model", kind="not_found_error")
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request)
        prompt_ids = completion_prompt(body, engine)
        return await generate(request, body, prompt_ids, sampling_params(body, 16), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request)
        prompt_ids = chat_prompt(body, engine)  # a reply may run until the context is full:
        params = sampling_params(body, room_for_reply(engine, len(prompt_ids)))
        return await generate(request, body, prompt_ids, params, chat=True)

    async def generate(request: Request, body: dict, prompt_ids: list[int], params: SamplingParams, chat: bool):
        stream_mode = field(body, "stream", (bool,), False)
        include_usage = bool(field(body, "stream_options", (dict,), {}).get("include_usage"))
        try:
            stream = await async_engine.submit(prompt_ids, params)
        except ValueError as e:  # prompt + max_tokens too long for max_model_len or the KV cache
            raise APIError(400, str(e)) from None
        except QueueFullError as e:
            raise APIError(503, str(e), kind="overloaded") from None
        except RuntimeError as e:  # the engine loop is not running
            raise APIError(503, str(e), kind="server_error") from None
        kind = ("chat.completion.chunk" if stream_mode else "chat.completion") if chat else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{stream.request_id}", "object": kind,
                "created": int(time.time()), "model": model_name}
        if stream_mode:
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
        except RuntimeError as e:  # the engine failed during this request
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
        except RuntimeError as e:  # the engine failed: tell the client inside the stream
            yield event({"error": {"message": str(e), "type": "server_error", "param": None, "code": 500}})
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
    parser.add_argument("--max-waiting", type=int, default=64, help="waiting requests before new ones get 503")
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
    app = build_app(AsyncEngine(engine, args.max_waiting, args.trace_steps), args.served_model_name)
    print(f"minicb: serving {args.served_model_name or engine.model_name} on http://{args.host}:{args.port}/v1 "
          f"({engine.config.num_blocks} KV blocks of {engine.config.block_size}, "
          f"{engine.config.max_num_seqs} slots, max_waiting={args.max_waiting})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)

"""An OpenAI-compatible HTTP server: real clients (curl, the openai package, chat UIs) on the
engine.

    python -m minicb serve          # the embedded SmolLM2-135M-Instruct on http://127.0.0.1:8000
    curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi!"}], "stream": true}'

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both stream server-sent
events ending in `data: [DONE]` when "stream": true), GET /health, GET /metrics (Prometheus text).
/openapi.json documents every body, field and status (the models are in protocol.py).
One HTTP request is one engine request per prompt (/v1/completions takes several), each with its n
samples; responses.py turns their outputs into OpenAI's choices, logprobs and usage.

Bad input is stopped at the edge, before it reaches the engine, because the engine's steps are
shared: one request that broke a step would fail every stream in flight. And no request may take
the service from everyone else, so every check that can refuse a request runs before any work
whose cost grows with the input (limits.py has the bounds and their defaults). In order:
  1. at most --limit-concurrency connections: one more takes the place of the longest idle one
     (503 if each has a request in flight), and one that has not sent a whole request within
     --timeout-request seconds is closed (connections.py);
  2. with --api-key, a request without the key gets 401 from its headers alone (auth.py);
  3. a body over --max-request-bytes gets 413 before it is read whole, one framed by both
     Content-Length and Transfer-Encoding 400; both close the connection (BodySizeLimit);
  4. JSON is parsed (in a worker thread over 64 KiB); then, before anything walks it, its lists
     and texts are refused from their lengths (RequestBounds.check_sizes: a token-id prompt
     longer than max_model_len, more prompts than a request may hold, too many stop strings,
     stop_token_ids or logit_bias entries, a text longer than max_model_len tokens could spell);
     then more than MAX_JSON_DEPTH nested containers or invalid Unicode ("\\ud800") gets 400;
  5. the pydantic models check every field's type and range, and sampling_params() what holds
     across fields (400 naming the field, never 422);
  6. what it asks: logprobs against --max-logprobs, n x prompts against --max-seats-per-request,
     n x prompts x max_tokens against --max-tokens-per-request;
  7. tokenizing and chat templating run in a worker thread; each prompt's length is checked
     against max_model_len once tokenized, before an echo detokenizes it (prompts.py);
  8. the engine refuses what only it can judge (the KV cache; a full server: 503 with
     Retry-After), and a request's prompts are admitted all or none.
A request that still fails inside a step is stopped alone (Engine._fail), and everyone else keeps
streaming. A client that hangs up aborts its requests at once, one that stops reading for
--stream-stall-timeout seconds too. Whole responses are built off the event loop (whole_response).
A dead engine answers 503 on /health (saying what died) and /v1/models. Every error body has
OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

import asyncio
import json
import time
from collections.abc import Sequence

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..sampling_params import SamplingParams
from ..structured_output import GrammarError, grammar_text
from .auth import APIKeyAuth, check_keys, document_bearer_auth
from .engine_loop import AsyncEngine, QueueFullError, RequestStream
from .limits import RequestBounds, RequestLimits, max_chars_per_token
from .prompts import room_for_reply, tokenize_chat, tokenize_prompts
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
    SamplingFields,
    StreamOptions,
)
from .responses import Choices, Prompt, vllm_prompt_logprobs
from .validation import (
    DEFAULT_MAX_REQUEST_BYTES,
    APIError,
    BodySizeLimit,
    CheckedJSONRoute,
    validation_error,
)

ERROR_STATUSES = {
    400: "invalid input (OpenAI error shape, naming the field)",
    401: "no API key, or a wrong one (a server started with --api-key; auth.py)",
    404: "model not served here",
    413: "body larger than --max-request-bytes",
    500: "the request failed inside the engine",
    503: "server full (Retry-After) or engine not running",
}
ERRORS = {
    code: {"model": ErrorResponse, "description": why} for code, why in ERROR_STATUSES.items()
}
STREAM = {
    "text/event-stream": {
        "schema": {  # one server-sent event
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {
                    "type": "string",
                    "description": "a JSON chunk (a CompletionResponse, or a "
                    "ChatCompletionChunk), an error object, or `[DONE]`, the last event",
                },
                "event": {"type": "string"},
            },
        }
    }
}


def to_sampling_params(body: SamplingFields, default_max_tokens: int) -> SamplingParams:
    try:
        params = body.sampling_params(default_max_tokens)
    except ValueError as e:  # SamplingParams names the field: "top_p must be in (0, 1], got 2"
        raise APIError(400, str(e), str(e).split()[0].split(".")[0]) from None
    if params.structured_outputs is not None:  # a schema or grammar that does not compile: 400
        try:
            grammar_text(params.structured_outputs)
        except GrammarError as e:
            field = "structured_outputs" if body.structured_outputs else "response_format"
            raise APIError(400, str(e), field) from None
    return params


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def last_outputs(stream: RequestStream) -> dict:
    """Each prompt's last RequestOutput, by prompt index."""
    last = {}
    async for outputs in stream:
        for out in outputs:
            last[stream.prompt_index[out.request_id]] = out
    return last


async def until_disconnect(request: Request, stream: RequestStream):
    """The stream's outputs until it ends or its client leaves. A client that hangs up aborts its
    requests at once, even while they produce nothing (waiting for a slot, in a long prefill): the
    disconnect is watched beside the stream, and aborting the stream ends its iteration, not the
    next write. (One that stops reading is the engine loop's to notice: RequestStream.stalled.)
    One watcher for the whole stream, not a race per output: at 64 clients the API process spends
    its CPU per streamed token, on the same cores as the engine (serve/README.md)."""
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    gone.add_done_callback(lambda _: stream.abort())  # even while a write is blocked
    try:
        async for out in stream:
            yield out
    finally:
        gone.cancel()
        stream.abort()


def whole_response(head: dict, choices: Choices, outputs: dict) -> StreamingResponse:
    """A response that is not streamed, built in a worker thread: echo and logprobs over many
    prompts make it tens of megabytes. A thread alone is not enough: one json.dumps of it all, or
    pydantic validating it, holds the GIL, and so stops the event loop, for seconds. So the dicts
    are built in the response models' shape (the defaults they would add set here), encoded one
    choice at a time, and sent piece by piece."""
    whole = choices.whole(outputs)
    rest = {**head, "usage": choices.usage()}
    if choices.chat:  # vLLM puts a chat's prompt logprobs beside its choices
        asked = choices.prompt_logprobs
        rest["prompt_logprobs"] = (
            vllm_prompt_logprobs(outputs[0].prompt_logprobs) if asked else None
        )
    else:
        for choice in whole:
            choice.setdefault("prompt_logprobs", None)
    # {"choices": [choice, choice, ...], "id": ..., "usage": ...}
    pieces = [b'{"choices":[']
    pieces += [(b"," if i else b"") + to_json(choice) for i, choice in enumerate(whole)]
    pieces.append(b"]," + to_json(rest)[1:])  # the other fields, after the choices
    length = sum(len(p) for p in pieces)
    return StreamingResponse(
        iter(pieces), media_type="application/json", headers={"content-length": str(length)}
    )


def to_json(value) -> bytes:
    """JSON as FastAPI's JSONResponse writes it (no NaN: responses.clamp keeps logprobs finite)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


# ---------------------------------------------------------------------- the app
def build_app(
    async_engine: AsyncEngine,
    served_model_name: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    limits: RequestLimits | None = None,
    api_key: str | Sequence[str] | None = None,
) -> FastAPI:
    """The app on `async_engine`. `api_key`: a key, or several (any one will do), that every
    route but /health, /metrics and the docs requires as `Authorization: Bearer <key>` (auth.py);
    None or empty: the server is open."""
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    check_keys(api_keys, "api_key")  # now, not when the first request builds the middleware
    engine = async_engine.engine
    model_name = served_model_name or engine.model_name
    bounds = RequestBounds(
        limits or RequestLimits(),
        engine.config,
        async_engine.capacity,
        max_chars_per_token(engine.tokenizer),
    )

    async def lifespan(app):
        async_engine.start(asyncio.get_running_loop())
        yield
        async_engine.stop()

    # a body sent without Content-Type is read as JSON too
    app = FastAPI(
        title="minicb",
        summary="OpenAI-compatible server of minicb, a continuous-batching engine",
        lifespan=lifespan,
        strict_content_type=False,
    )
    app.router.route_class = CheckedJSONRoute
    app.state.check_sizes = bounds.check_sizes  # CheckedJSONRequest runs it on the parsed JSON
    # one large body parsed at a time: json.loads holds the GIL, and 40 threads parsing at once
    # kept the event loop waiting for its turn (the others wait on the loop, where it is free)
    app.state.parse_limiter = anyio.CapacityLimiter(1)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if api_keys:  # added last, so outermost: a request without the key is refused first
        app.add_middleware(APIKeyAuth, keys=api_keys)
        schema = app.openapi
        app.openapi = lambda: document_bearer_auth(schema())

    # APIError, unknown route, wrong method, 413: one error body
    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        if isinstance(e, APIError):
            return e.response()
        # keeps Allow on a 405
        return APIError(
            e.status_code, f"{request.method} {request.url.path}: {e.detail}", headers=e.headers
        ).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        return validation_error(e).response()

    @app.exception_handler(Exception)  # a bug answers 500 with a body; the server keeps serving
    async def internal_error(request, e: Exception):
        return APIError(
            500, f"internal error: {type(e).__name__}: {e}", kind="server_error"
        ).response()

    def check_engine() -> None:
        """503 naming what died: the engine core (with its exit code) or the engine loop; with
        data parallelism, only once no replica can serve."""
        failure = async_engine.failure()
        if failure is not None:
            raise APIError(503, failure, kind="server_error")

    @app.get("/health", responses={503: ERRORS[503]})
    async def health() -> dict[str, str]:
        check_engine()
        return {"status": "ok"}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {
                "content": {"text/plain": {"schema": {"type": "string"}}},
                "description": "Prometheus text exposition format",
            }
        },
    )
    async def metrics():
        return PlainTextResponse(
            async_engine.metrics_text(), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401], 503: ERRORS[503]})
    async def models():
        check_engine()  # a model that cannot answer is not served
        return {
            "object": "list",
            "data": [{"id": model_name, "max_model_len": engine.config.max_model_len}],
        }

    def check_model(body: SamplingFields) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(
                404,
                f"model {body.model!r} is not served here; this server serves {model_name!r}",
                "model",
                kind="not_found_error",
            )

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: {"content": STREAM}, **ERRORS},
    )
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        params = to_sampling_params(body, 16)
        prompts = body.prompts()
        bounds.check_logprobs(logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs)
        bounds.check_seats(body.n, len(prompts))
        bounds.check_tokens(body.n, len(prompts), params.max_tokens)
        tokenized = await run_in_threadpool(
            tokenize_prompts, engine, prompts, params, body.priority, body.echo
        )
        choices = Choices(
            tokenized,
            engine.tokenizer,
            chat=False,
            stream=body.stream,
            n=body.n,
            num_logprobs=body.logprobs,
            echo=body.echo,
            prompt_only=body.prompt_only,
            prompt_logprobs=body.prompt_logprobs is not None,
        )
        return await generate(request, body, params, choices)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={200: {"content": STREAM}, **ERRORS},
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        bounds.check_logprobs(top_logprobs=body.top_logprobs, prompt_logprobs=body.prompt_logprobs)
        bounds.check_seats(body.n, 1)
        # Every field is checked before the template runs, with the longest reply the request can
        # get; the default reply fills the room the prompt leaves, so params are made again after.
        longest = bounds.default_max_tokens(body.n, engine.config.max_model_len - 1)
        bounds.check_tokens(body.n, 1, to_sampling_params(body, longest).max_tokens)
        prompt_ids = await run_in_threadpool(tokenize_chat, engine, body)
        room = room_for_reply(engine, len(prompt_ids))
        params = to_sampling_params(body, bounds.default_max_tokens(body.n, room))
        choices = Choices(
            [Prompt(prompt_ids)],
            engine.tokenizer,
            chat=True,
            stream=body.stream,
            n=body.n,
            num_logprobs=body.num_top_logprobs,
            prompt_logprobs=body.prompt_logprobs is not None,
        )
        return await generate(request, body, params, choices)

    async def generate(
        request: Request, body: SamplingFields, params: SamplingParams, choices: Choices
    ):
        try:
            stream = await async_engine.submit(
                [p.token_ids for p in choices.prompts], params, body.priority, user=body.user
            )
        # too long for the KV cache; a priority without the policy
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except QueueFullError as e:
            raise APIError(503, str(e), kind="overloaded") from None
        except RuntimeError as e:  # the engine loop is not running
            raise APIError(503, str(e), kind="server_error") from None
        chat = choices.chat
        kind = (
            ("chat.completion.chunk" if body.stream else "chat.completion")
            if chat
            else "text_completion"
        )
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{stream.id}",
            "object": kind,
            "created": int(time.time()),
            "model": model_name,
        }
        if body.stream:
            usage = body.stream_options or StreamOptions()
            return StreamingResponse(
                sse(request, stream, head, choices, usage), media_type="text/event-stream"
            )
        # Not streaming: wait for the last outputs, but abort if the client hangs up meanwhile.
        result = asyncio.ensure_future(last_outputs(stream))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not result.done():
            result.cancel()  # its `async for` ends with CancelledError, which aborts the requests
            return JSONResponse({}, status_code=499)  # nobody is listening any more
        try:
            outputs = result.result()
        except RuntimeError as e:  # a request failed inside the engine
            raise APIError(500, str(e), kind="server_error") from None
        return await run_in_threadpool(whole_response, head, choices, outputs)

    async def sse(
        request: Request,
        stream: RequestStream,
        head: dict,
        choices: Choices,
        usage: StreamOptions,
    ):
        """Server-sent events. With stream_options.include_usage a last chunk carries the token
        counts; with continuous_usage_stats too, every chunk carries the counts so far (vLLM's
        extension)."""
        counts = (
            (lambda: {"usage": choices.usage()})
            if usage.include_usage and usage.continuous_usage_stats
            else (lambda: {})
        )
        event = lambda payload: f"data: {json.dumps(payload)}\n\n"
        if choices.chat:  # OpenAI opens a chat stream with the role
            yield event({**head, "choices": choices.opening()})
        failed = False
        try:
            # each chunk: the choices that changed, each with only what is new
            async for outputs in until_disconnect(request, stream):
                changed = [
                    c
                    for out in outputs
                    for c in choices.update(stream.prompt_index[out.request_id], out)
                ]
                if changed:
                    yield event(
                        {**head, "choices": sorted(changed, key=lambda c: c["index"]), **counts()}
                    )
        # a request failed inside the engine: tell the client in the stream
        except RuntimeError as e:
            yield event(
                {"error": {"message": str(e), "type": "server_error", "param": None, "code": 500}}
            )
            failed = True
        finally:  # the client hung up (this generator was cancelled or closed): free the blocks now
            stream.abort()
        if usage.include_usage and not failed:
            yield event({**head, "choices": [], "usage": choices.usage()})
        yield "data: [DONE]\n\n"

    return app

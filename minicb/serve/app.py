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
shared: one request that broke a step would fail every stream in flight. In order:
  1. a body over --max-request-bytes gets 413 before it is read whole (BodySizeLimit);
  2. JSON is parsed here: nesting deeper than MAX_JSON_DEPTH or a string that is not valid Unicode
     (a lone surrogate such as "\ud800") gets 400;
  3. the pydantic models check every field's type and range, and sampling_params() what holds
     across fields (400 naming the field, never 422);
  4. tokenization and chat templating run in a worker thread, so a huge prompt costs its own
     sender and nobody else: the event loop keeps serving other clients meanwhile;
  5. the engine refuses what only it can judge (prompt + max_tokens > max_model_len, n >
     max_num_seqs): 400, and a request's prompts are admitted all or none.
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

from ..engine.llm import chat_token_ids
from ..sampling_params import SamplingParams
from .engine_loop import AsyncEngine, QueueFullError, RequestStream
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
from .responses import Choices, Prompt, echoed_prompt, vllm_prompt_logprobs
from .validation import (
    DEFAULT_MAX_REQUEST_BYTES,
    APIError,
    BodySizeLimit,
    CheckedJSONRoute,
    validation_error,
)

ERROR_STATUSES = {
    400: "invalid input (OpenAI error shape, naming the field)",
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


def room_for_reply(engine, num_prompt_tokens: int) -> int:
    """Default max_tokens of a chat reply: whatever max_model_len and the KV cache leave."""
    c = engine.config
    room = min(
        c.max_model_len - num_prompt_tokens, c.num_blocks * c.block_size - num_prompt_tokens + 1
    )
    if room <= 0:
        raise APIError(
            400,
            f"prompt has {num_prompt_tokens} tokens, which leaves no room for a reply "
            f"(max_model_len is {c.max_model_len})",
            "messages",
        )
    return room


def to_sampling_params(body: SamplingFields, default_max_tokens: int) -> SamplingParams:
    try:
        return body.sampling_params(default_max_tokens)
    except ValueError as e:  # SamplingParams names the field: "top_p must be in (0, 1], got 2"
        raise APIError(400, str(e), str(e).split()[0]) from None


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


# ---------------------------------------------------------------------- the app
def build_app(
    async_engine: AsyncEngine,
    served_model_name: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    engine = async_engine.engine
    model_name = served_model_name or engine.model_name

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
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)

    @app.exception_handler(
        HTTPException
    )  # APIError, unknown route, wrong method, 413: one error body
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

    @app.get("/health", responses={503: ERRORS[503]})
    async def health() -> dict[str, str]:
        if not async_engine.is_running:
            raise APIError(503, "the engine loop is not running", kind="server_error")
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

    @app.get("/v1/models", response_model=ModelList)
    async def models():
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

    def tokenize_prompts(prompts: list, echo: bool) -> list[Prompt]:
        tokenized = []
        for i, prompt in enumerate(prompts):
            try:
                ids = engine.tokenize(prompt)
            except ValueError as e:
                raise APIError(
                    400, (f"prompt {i}: " if len(prompts) > 1 else "") + str(e), "prompt"
                ) from None
            text = prompt if isinstance(prompt, str) else None
            tokenized.append(echoed_prompt(engine.tokenizer, text, ids) if echo else Prompt(ids))
        return tokenized

    def tokenize_chat(body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        tokenizer = engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(
                400,
                f"model {engine.model_name!r} has no chat template: use /v1/completions",
                "messages",
            )
        try:
            return chat_token_ids(tokenizer, messages)
        except (
            Exception
        ) as e:  # templates may refuse some conversations (e.g. roles that do not alternate)
            raise APIError(
                400, f"the chat template refused these messages: {e}", "messages"
            ) from None

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: {"content": STREAM}, **ERRORS},
    )
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        params = to_sampling_params(body, 16)
        prompts = body.prompts()
        if len(prompts) > async_engine.capacity:  # it could never be admitted whole
            raise APIError(
                400,
                f"{len(prompts)} prompts in one request, but this server holds at most "
                f"{async_engine.capacity} requests (max_num_seqs + max_waiting)",
                "prompt",
            )
        # off the event loop
        tokenized = await run_in_threadpool(tokenize_prompts, prompts, body.echo)
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
        prompt_ids = await run_in_threadpool(tokenize_chat, body)  # off the event loop
        params = to_sampling_params(body, room_for_reply(engine, len(prompt_ids)))
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
                [p.token_ids for p in choices.prompts], params, body.priority
            )
        except (
            ValueError
        ) as e:  # too long for max_model_len or the KV cache; a priority without the policy
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
                sse(stream, head, choices, usage), media_type="text/event-stream"
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
        response = {**head, "choices": choices.whole(outputs), "usage": choices.usage()}
        if (
            chat and choices.prompt_logprobs
        ):  # vLLM puts a chat's prompt logprobs beside its choices
            response["prompt_logprobs"] = vllm_prompt_logprobs(outputs[0].prompt_logprobs)
        return response

    async def sse(stream: RequestStream, head: dict, choices: Choices, usage: StreamOptions):
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
            async for (
                outputs
            ) in stream:  # each chunk: the choices that changed, each with only what is new
                changed = [
                    c
                    for out in outputs
                    for c in choices.update(stream.prompt_index[out.request_id], out)
                ]
                if changed:
                    yield event(
                        {**head, "choices": sorted(changed, key=lambda c: c["index"]), **counts()}
                    )
        except (
            RuntimeError
        ) as e:  # a request failed inside the engine: tell the client in the stream
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

"""Validation at the edge: what the server checks before a request can reach the engine.

The engine's steps are shared, so one request that broke a step would fail every stream in flight;
everything a client can get wrong is therefore refused here, with a 400 (413 for a body too large)
in OpenAI's error shape that names the field:
  1. BodySizeLimit: a body over --max-request-bytes is refused before it is read whole;
  2. CheckedJSONRequest parses the JSON (in a worker thread when the body is large) and refuses
     lists and texts too large to take from their lengths alone (limits.py), more than
     MAX_JSON_DEPTH nested containers, and a string that is not valid Unicode (a lone surrogate
     such as "\\ud800", which JSON's escapes can spell);
  3. the pydantic models of protocol.py check every field's type and range, and
     validation_error() turns FastAPI's 422 into OpenAI's 400.
"""

import json

import anyio
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from .protocol import UNSUPPORTED

MAX_JSON_DEPTH = 16  # the deepest real body (chat content parts) is 5 levels
# ~1M tokens of text: far beyond any prompt a model here can take
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


class APIError(HTTPException):
    """An error a client should see, in OpenAI's shape. An HTTPException, so that FastAPI passes it
    through untouched even when it is raised while the body is being parsed."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(status, message, headers)
        self.message, self.param, self.kind = message, param, kind

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status_code,
            }
        }
        headers = dict(self.headers or {})
        if self.status_code == 503:
            headers["Retry-After"] = "1"
        return JSONResponse(body, status_code=self.status_code, headers=headers or None)


def check_json(value, depth: int = 0, field: str | None = None) -> None:
    """Refuse more than MAX_JSON_DEPTH nested containers (objects and arrays) and strings that are
    not valid Unicode. `depth`: the containers around `value`; `field`: the top-level field being
    checked, named in the error."""
    if isinstance(value, str):
        check_unicode(value, field)
        return
    if not isinstance(value, (dict, list)):
        return  # a number, a bool or null nests nothing
    depth += 1
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"JSON is nested more than {MAX_JSON_DEPTH} levels deep", field)
    if isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k, field)
            check_json(v, depth, k if depth == 1 else field)
        return
    for v in value:
        if isinstance(v, (str, dict, list)):  # a long list of token ids costs one test each
            check_json(v, depth, field)


def check_unicode(text: str, field: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, which JSON's \\uXXXX escapes can spell
        raise APIError(
            400,
            f"'{field or 'body'}' is not valid Unicode: {e.reason} at position {e.start}",
            field,
        ) from None


def parse_json(body: bytes, check_sizes=None):
    """The body as JSON, refused (APIError) if it nests too deep, holds invalid Unicode, or, by
    `check_sizes` (limits.RequestBounds.check_sizes), holds lists or texts too large to take. The
    sizes are checked first: a 2-million-id prompt is refused from its length, not walked."""
    try:
        value = json.loads(body)
    except RecursionError:  # Python's parser gives up near 1,000 levels
        raise APIError(400, f"JSON is nested more than {MAX_JSON_DEPTH} levels deep") from None
    if check_sizes is not None:
        check_sizes(value)
    check_json(value)
    return value


class BodySizeLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, before it is read whole. A declared
    Content-Length over the limit is answered at once, without reading a byte; a body sent in chunks
    is cut off as soon as the bytes received pass the limit (the handler's read raises APIError).
    Either way the 413 closes the connection (`Connection: close`), or the server would go on
    reading the rest of the body. A request that declares both a Content-Length and a
    Transfer-Encoding gets 400 and is closed too: the two framings can disagree about where the
    body ends (request smuggling), and HTTP/1.1 lets a server refuse such a message (RFC 9112,
    6.3). (FastAPI's own max_body_size also answers 413, but in plain text, not OpenAI's shape.)"""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        close = {"Connection": "close"}
        headers = Headers(scope=scope)
        length = headers.get("content-length", "")
        if length and "transfer-encoding" in headers:
            both = APIError(
                400,
                "a request may not declare both Content-Length and Transfer-Encoding",
                headers=close,
            )
            return await both.response()(scope, receive, send)
        too_large = APIError(
            413,
            f"request body is larger than {self.max_bytes} bytes (--max-request-bytes)",
            headers=close,
        )
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


# json.loads and check_json take about 2 ms for 64 KiB here: a larger body is parsed in a worker
# thread, so that 4 MiB of token ids (~250 ms) do not stop every other client meanwhile
PARSE_IN_THREAD_BYTES = 64 * 2**10


class CheckedJSONRequest(Request):
    """A request whose JSON goes through parse_json(), with the app's size checks and its limiter
    of parsing threads (app.state.check_sizes and parse_limiter, set by build_app)."""

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            check_sizes = getattr(self.app.state, "check_sizes", None)
            if len(body) > PARSE_IN_THREAD_BYTES:
                limiter = getattr(self.app.state, "parse_limiter", None)  # None: anyio's own
                self._json = await anyio.to_thread.run_sync(
                    parse_json, body, check_sizes, limiter=limiter
                )
            else:
                self._json = parse_json(body, check_sizes)
        return self._json


class CheckedJSONRoute(APIRoute):
    """A route whose body goes through CheckedJSONRequest.json() before FastAPI validates it."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            return await handler(CheckedJSONRequest(request.scope, request.receive))

        return checked


TYPE_TAGS = (
    "str",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "none",
    "constrained",
    "literal",
    "function",
)
PROMPT_FORMS = (
    "a non-empty string, a list of integer token ids, or a non-empty list of either "
    "(several prompts)"
)


def validation_error(e: RequestValidationError) -> APIError:
    """FastAPI's 422 becomes OpenAI's 400, naming the first field at fault."""
    err = e.errors()[0]
    # pydantic puts union members' type names in the location ("prompt", "str"): keep field names
    # only
    loc = [
        f"[{x}]" if isinstance(x, int) else x
        for x in err.get("loc", ())
        if x != "body" and not (isinstance(x, str) and x.split("-")[0].split("[")[0] in TYPE_TAGS)
    ]
    field = loc[0] if loc else None
    path = (
        "".join(x if x.startswith("[") or i == 0 else f".{x}" for i, x in enumerate(loc)) or "body"
    )
    if err.get("type") == "json_invalid":
        return APIError(
            400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}"
        )
    if not loc and err.get("type") in ("model_attributes_type", "dict_type"):
        return APIError(400, "request body must be a JSON object (Content-Type: application/json)")
    if err["type"] == "missing":
        return APIError(400, f"'{path}' is required", field)
    neutral = UNSUPPORTED.get(field)
    # the right type, but a value minicb lacks
    is_unsupported_value = neutral is not None and not err["type"].endswith("_type")
    if is_unsupported_value:
        return APIError(400, f"'{field}' is not supported by minicb (only {neutral})", field)
    if (
        field == "logit_bias" and err["type"] == "string_pattern_mismatch"
    ):  # a key that is no token id
        return APIError(
            400,
            f"'logit_bias' keys must be token ids written as strings (OpenAI's format, "
            f'e.g. {{"50256": -100}}), got {json.dumps(err.get("input"))[:50]}',
            field,
        )
    if field == "prompt":
        return APIError(400, f"'prompt' must be {PROMPT_FORMS}", "prompt")
    got = json.dumps(err.get("input"))[:50] if err.get("input") is not None else "nothing"
    return APIError(400, f"'{path}': {err['msg']} (got {got})", field)

"""Validation at the edge: what the server checks before a request can reach the engine.

The engine's steps are shared, so one request that broke a step would fail every stream in flight;
everything a client can get wrong is therefore refused here, with a 400 (413 for a body too large)
in OpenAI's error shape that names the field:
  1. BodySizeLimit: a body over --max-request-bytes is refused before it is read whole;
  2. CheckedJSONRequest: JSON nested deeper than MAX_JSON_DEPTH, or a string that is not valid
     Unicode (a lone surrogate such as "\\ud800", which JSON's escapes can spell), is refused;
  3. the pydantic models of protocol.py check every field's type and range, and
     validation_error() turns FastAPI's 422 into OpenAI's 400.
"""

import json

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


def check_json(value, depth: int = 1, field: str | None = None) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings that are not valid Unicode.
    `field`: the top-level field being checked, named in the error."""
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"JSON is nested more than {MAX_JSON_DEPTH} levels deep", field)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, which JSON's \\uXXXX escapes can spell
            raise APIError(
                400,
                f"'{field or 'body'}' is not valid Unicode: {e.reason} at position {e.start}",
                field,
            ) from None
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
        too_large = APIError(
            413, f"request body is larger than {self.max_bytes} bytes (--max-request-bytes)"
        )
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
                raise APIError(
                    400, f"JSON is nested more than {MAX_JSON_DEPTH} levels deep"
                ) from None
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
    if err.get("type") == "json_invalid":
        return APIError(
            400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}"
        )
    if not loc and err.get("type") in ("model_attributes_type", "dict_type"):
        return APIError(400, "request body must be a JSON object (Content-Type: application/json)")
    neutral = UNSUPPORTED.get(field)
    if neutral is not None and not err["type"].endswith(
        "_type"
    ):  # right type, a value minicb lacks
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
    if field == "prompt" and err["type"] != "missing":
        return APIError(400, f"'prompt' must be {PROMPT_FORMS}", "prompt")
    got = json.dumps(err.get("input"))[:50] if err.get("input") is not None else "nothing"
    path = (
        "".join(x if x.startswith("[") or i == 0 else f".{x}" for i, x in enumerate(loc)) or "body"
    )
    if err["type"] == "missing":
        return APIError(400, f"'{path}' is required", field)
    return APIError(400, f"'{path}': {err['msg']} (got {got})", field)

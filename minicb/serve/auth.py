"""Who may use the endpoint: `serve --api-key KEY` (vLLM's flag; without it, the environment
variable VLLM_API_KEY, as in vLLM) makes the API answer only requests that carry
`Authorization: Bearer KEY`, the header the openai client sends for `api_key=KEY`.

A server shared by a class listens beyond loopback, and without a key anyone who can reach it may
use it. With one, a request without the key, with another scheme than Bearer, or with a wrong key
gets 401 in OpenAI's error shape, and nothing else happens: APIKeyAuth is the app's outermost ASGI
layer, so it answers from the request's headers alone, before the body is read, parsed or
validated, and long before anything reaches the engine.

What stays open, as in vLLM V1 (PUBLIC_ENDPOINTS of its AuthenticationMiddleware): /health, a
load balancer's probe, which carries no key; /metrics, which Prometheus scrapes without one (it
holds counts and times, never a prompt or a key); and the API's documentation (/openapi.json,
/docs, /redoc). Everything else needs the key, every /v1 route included, and so would a route
added later: the open paths are listed, not the guarded ones (fail closed, as vLLM's guard is).
OPTIONS passes, as in vLLM: a browser's CORS preflight carries no credentials, and no OPTIONS
request reaches the engine.

The comparison takes the same time however much of a guess is right: the key and the token sent
are each hashed with SHA-256 and the digests compared with hmac.compare_digest (compared alone,
tokens of different lengths would be refused at once, telling the key's length). With several
keys (vLLM's --api-key takes several), every one is compared. No message, log line or metric
shows a key or the token a client sent.
"""

import hashlib
import hmac
import os
from collections.abc import Sequence

from .validation import APIError

ENV_VAR = "VLLM_API_KEY"  # vLLM's name
PUBLIC_PATHS = frozenset(
    {"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)
HOW = "send the header 'Authorization: Bearer <key>' (the openai client: api_key=<key>)"


def api_keys_from(flag: Sequence[str] | None, environ=os.environ) -> tuple[str, ...]:
    """The keys a server started with `--api-key flag` requires: the flag's, else the environment
    variable VLLM_API_KEY's (the flag wins, as in vLLM; an empty variable is no key). An empty
    tuple: the server is open. Raises ValueError naming the flag or the variable, never the key."""
    if flag:
        check_keys(flag, "--api-key")
        return tuple(flag)
    key = environ.get(ENV_VAR, "")
    if not key:
        return ()
    check_keys([key], ENV_VAR)
    return (key,)


def check_keys(keys: Sequence[str], source: str = "api_key") -> None:
    """A key must travel unchanged in an HTTP header: printable ASCII without spaces (what
    Bearer tokens are made of, RFC 6750). The error names `source` and never shows the key."""
    for key in keys:
        if not key:
            raise ValueError(f"{source} is empty: a key of at least one character is required")
        is_header_safe = all("!" <= c <= "~" for c in key)
        if not is_header_safe:
            raise ValueError(
                f"{source} must be printable ASCII without spaces or control characters "
                "(the key is not shown here)"
            )


def digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class APIKeyAuth:
    """ASGI middleware: 401 in OpenAI's shape for a request to any path but PUBLIC_PATHS that does
    not carry one of `keys` as `Authorization: Bearer <key>`. Only the digests of the keys are
    kept."""

    def __init__(self, app, keys: Sequence[str]):
        check_keys(keys)
        if not keys:
            raise ValueError("APIKeyAuth needs at least one key")
        self.app = app
        self.digests = tuple(digest(key.encode("ascii")) for key in keys)

    async def __call__(self, scope, receive, send):
        is_open = (
            scope["type"] != "http"  # lifespan; the server has no websocket route
            or scope["method"] == "OPTIONS"
            or scope["path"] in PUBLIC_PATHS
        )
        if is_open:
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope["headers"])
        if refusal is None:
            return await self.app(scope, receive, send)
        headers = {"WWW-Authenticate": "Bearer"}  # RFC 7235: a 401 names the scheme it wants
        sends_body = any(
            name in (b"content-length", b"transfer-encoding") for name, _ in scope["headers"]
        )
        if sends_body:  # the body is never read: close, rather than read it to reach the next one
            headers["Connection"] = "close"
        error = APIError(401, refusal, kind="invalid_request_error", headers=headers)
        await error.response()(scope, receive, send)

    def refusal(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """Why a request with these (raw ASGI) headers is refused, or None if its key is right."""
        values = [value for name, value in headers if name == b"authorization"]
        if not values:
            return f"this server requires an API key: {HOW}"
        scheme, _, token = values[0].partition(b" ")
        is_bearer = len(values) == 1 and scheme.lower() == b"bearer" and token != b""
        if not is_bearer:
            return f"the Authorization header must be one 'Bearer <key>': {HOW}"
        sent = digest(token)
        matches = False
        for key in self.digests:  # every key compared: the time does not tell which one matched
            matches |= hmac.compare_digest(sent, key)
        return None if matches else "the API key is not valid for this server"


def document_bearer_auth(schema: dict) -> dict:
    """The OpenAPI schema with HTTP Bearer auth on every guarded operation, so that /docs asks
    for the key (its Authorize button) and sends it with 'Try it out'."""
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes["APIKey"] = {
        "type": "http",
        "scheme": "bearer",
        "description": f"--api-key or {ENV_VAR}",
    }
    for path, operations in schema.get("paths", {}).items():
        if path in PUBLIC_PATHS:
            continue
        for operation in operations.values():
            operation["security"] = [{"APIKey": []}]
    return schema

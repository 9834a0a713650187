"""Pure ASGI middleware, run before FastAPI parses anything: request ids and the last word on
unexpected errors, the API key, the request size."""
from __future__ import annotations

import logging
import secrets
import uuid

from fastapi.responses import JSONResponse

from ddtree.server.protocol import error_body

log = logging.getLogger("ddtree.server")

REQUEST_ID_HEADER = b"x-request-id"


def _json_error(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def request_id_of(scope) -> str:
    return scope.get("state", {}).get("request_id", "-")


def internal_error_body(request_id: str) -> dict:
    """What a client sees of a server fault: no internal message, the id to quote; the log has the rest."""
    return error_body(f"internal server error; the server log has the details under request id {request_id}",
                      type="server_error", code="internal_error")


class RequestIdMiddleware:
    """Gives every HTTP request an id (`request.state.request_id`, the `x-request-id` response
    header, the response's own id) and turns an unexpected exception into a 500 whose body holds
    that id and nothing internal, logging the exception under it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s (%s %s) failed", request_id, scope.get("method"), scope.get("path"))
            if not started:
                await _json_error(500, internal_error_body(request_id))(scope, receive, send_with_id)


KEYED_PATHS = ("/tokenize", "/detokenize")  # use the model, as /v1/* do: same key


class ApiKeyMiddleware:
    """401 for /v1/*, /tokenize and /detokenize requests without `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in KEYED_PATHS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                body = error_body("missing or incorrect API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
                await _json_error(401, body)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """400 for request bodies over `max_bytes`; the body is read (and dropped) first so the client
    always gets the answer, and the connection is closed after it. Within the limit, the body is
    replayed to the app unchanged. (How long a body may take to arrive is the connection's read
    timeout, ddtree.server.connection.)"""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
            if size > 8 * self.max_bytes:  # stop reading a flood
                break
        if size > self.max_bytes:
            body = error_body(f"request body is {size if not more else 'over ' + str(size)} bytes; "
                              f"the limit is {self.max_bytes} (--max-request-bytes)", code="request_too_large")
            await _json_error(400, body, {"connection": "close"})(scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

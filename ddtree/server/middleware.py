"""Pure ASGI middleware, run before FastAPI parses anything: the API key and the request size."""
from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse

from ddtree.server.protocol import error_body


def _json_error(status: int, body: dict) -> JSONResponse:
    return JSONResponse(body, status_code=status)


class ApiKeyMiddleware:
    """401 for /v1/* requests without `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                body = error_body("missing or incorrect API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
                await _json_error(401, body)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """400 for request bodies over `max_bytes`; the body is read (and dropped) first so the client
    always gets the answer. Within the limit, the body is replayed to the app unchanged."""

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
            if size > 8 * self.max_bytes:  # stop reading a flood; the connection gets closed
                break
        if size > self.max_bytes:
            body = error_body(f"request body is {size if not more else 'over ' + str(size)} bytes; "
                              f"the limit is {self.max_bytes} (--max-request-bytes)", code="request_too_large")
            await _json_error(400, body)(scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

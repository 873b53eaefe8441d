"""What the project's HTTP servers refuse before their handlers see a request's body: one too large, of unknown
length, or that does not arrive in time (a client that sends its headers and then trickles or withholds the body
would otherwise hold a connection, and its handler, for good)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

BODY_TIMEOUT_S = 30.0  # for the whole body, from the end of the headers


def _refusal(headers: Any, max_bytes: int, what: str) -> tuple[int, str] | None:
    """(status, reason) for a refused request with a body, None to go on. The HTTP parser holds the client to the
    length it declared. `what` says how to send less."""
    length = headers.get("content-length", "")
    if not length.isdigit():
        return 411, "send the body with a Content-Length header (no chunked bodies)"
    if int(length) > max_bytes:
        return 413, f"the body is {int(length):,} bytes; at most {max_bytes:,} are accepted: {what}"
    return None


class BodyLimit:
    """ASGI middleware: `respond(status, reason)` (a response) for the POST/PUT/PATCH requests whose body is too large
    to read, of unknown length, or not all there within `BODY_TIMEOUT_S` (408; the connection then closes). The body
    is read here and handed to the app whole. Plain ASGI, not `@app.middleware("http")`, whose wrapper costs every
    request a task group and a streamed body."""

    def __init__(self, app: Any, max_bytes: int, what: str, respond: Callable[[int, str], Any]):
        self.app, self.max_bytes, self.what, self.respond = app, max_bytes, what, respond
        self.timeout = BODY_TIMEOUT_S

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            if refusal := _refusal(headers, self.max_bytes, self.what):
                await self.respond(*refusal)(scope, receive, send)
                return
            try:
                body = await asyncio.wait_for(_body(receive), self.timeout)
            except TimeoutError:
                await self.respond(408, f"the body did not arrive within {self.timeout:g} s")(scope, receive, send)
                return
            if body is None:  # the client went away
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


async def _body(receive: Callable) -> bytes | None:
    """The request's whole body, None if the client disconnects first."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Callable) -> Callable:
    """A `receive` that gives the app `body` in one message, then what the connection sends (its disconnect)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay

"""What the project's HTTP servers (the retriever, the gateway) refuse before they read a request's body."""

from __future__ import annotations

from typing import Any, Callable


def _refusal(headers: Any, method: str, max_bytes: int, what: str) -> tuple[int, str] | None:
    """(status, reason) for a refused request, None to go on. The HTTP parser holds the client to the length it
    declared. `what` says how to send less."""
    if method not in ("POST", "PUT", "PATCH"):
        return None
    length = headers.get("content-length", "")
    if not length.isdigit():
        return 411, "send the body with a Content-Length header (no chunked bodies)"
    if int(length) > max_bytes:
        return 413, f"the body is {int(length):,} bytes; at most {max_bytes:,} are accepted: {what}"
    return None


class BodyLimit:
    """ASGI middleware: `respond(status, reason)` (a response) for the POST/PUT/PATCH requests whose body is too large
    to read, or of unknown length. Plain ASGI, not `@app.middleware("http")`, whose wrapper costs every request a task
    group and a streamed body."""

    def __init__(self, app: Any, max_bytes: int, what: str, respond: Callable[[int, str], Any]):
        self.app, self.max_bytes, self.what, self.respond = app, max_bytes, what, respond

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            if refusal := _refusal(headers, scope["method"], self.max_bytes, self.what):
                await self.respond(*refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

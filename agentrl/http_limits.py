"""What the project's HTTP servers (the retriever, the gateway) refuse before they read a request's body."""

from __future__ import annotations

from typing import Any


def body_refusal(request: Any, max_bytes: int, what: str) -> tuple[int, str] | None:
    """(status, reason) for a POST/PUT/PATCH (a starlette `Request`) whose body is too large to read, or of unknown
    length; None to go on. The HTTP parser holds the client to the length it declared. `what` says how to send less."""
    if request.method not in ("POST", "PUT", "PATCH"):
        return None
    length = request.headers.get("content-length", "")
    if not length.isdigit():
        return 411, "send the body with a Content-Length header (no chunked bodies)"
    if int(length) > max_bytes:
        return 413, f"the body is {int(length):,} bytes; at most {max_bytes:,} are accepted: {what}"
    return None

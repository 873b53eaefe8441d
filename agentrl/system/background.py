"""An event loop in a daemon thread, for sync code that drives async clients (MCP sessions, judge requests) from
any thread, including threads that run an event loop of their own, where `asyncio.run` is not allowed.

    loop = BackgroundLoop("agentrl-mcp")
    result = loop.run(client.call(...), timeout=10)   # blocks this thread; TimeoutError after 10 s
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any


class BackgroundLoop:
    """A loop of its own in a daemon thread; `run` waits on it from any other thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=name, daemon=True).start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """`coro`'s result, run on the loop; TimeoutError (the coroutine cancelled) after `timeout` seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError from None

"""Listening sockets for the HTTP servers that run inside this process (the gateway, the web shop)."""

from __future__ import annotations

import socket


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to (`host`, `port`; 0: a free one), with Nagle's algorithm off for the connections it
    accepts. A plain `socket.socket()` has protocol 0, so asyncio does not set TCP_NODELAY on them: a response written
    as headers then body waits for the client's delayed ACK (~40 ms per request on Linux when the client runs on the
    server's event loop, as an agent program does beside the gateway in training)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio's transports then set it
    sock.bind((host, port))
    return sock

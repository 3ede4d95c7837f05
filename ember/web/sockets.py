"""Listening sockets, bound before anything else starts: a port in use is an error that names it,
not a server's traceback after the model has loaded."""

from __future__ import annotations

import socket

from ember.errors import EmberError


def listen(host: str, port: int, what: str) -> socket.socket:
    """A listening socket on host:port (0 = a free port); connections queue until the server runs.
    `what` names where host and port came from, for the error."""
    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off on the connections it accepts only
    # for a socket that says it is TCP; with it on, a streamed answer's first chunk waited ~40 ms
    # for the client's delayed ACK on a keep-alive connection. Set here too, for any server.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted connections inherit it
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        held = " (another program listens there)" if e.errno == 98 else ""
        raise EmberError(f"{what}: cannot listen on {host}:{port}: {e.strerror}{held}; choose another "
                         f"port, or 0 for a free one") from None
    sock.listen(128)
    return sock

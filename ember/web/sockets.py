"""Listening sockets, bound before anything else starts: a port in use is an error that names it,
not a server's traceback after the model has loaded."""

from __future__ import annotations

import socket

from ember.errors import EmberError


def listen(host: str, port: int, what: str) -> socket.socket:
    """A listening socket on host:port (0 = a free port); connections queue until the server runs.
    `what` names where host and port came from, for the error."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        held = " (another program listens there)" if e.errno == 98 else ""
        raise EmberError(f"{what}: cannot listen on {host}:{port}: {e.strerror}{held}; choose another "
                         f"port, or 0 for a free one") from None
    sock.listen(128)
    return sock

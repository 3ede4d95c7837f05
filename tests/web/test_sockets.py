"""The listening sockets every ember server takes (ember.web.sockets): the service's API and
dashboard, the built-in inference worker, co-serving."""

from __future__ import annotations

import asyncio
import socket

from ember.web.sockets import listen


def test_the_servers_connections_send_small_writes_at_once():
    """Nagle's algorithm off on each accepted connection, as asyncio sets it for TCP sockets. The
    socket was made with protocol 0, which asyncio does not take for TCP, so it left Nagle on: a
    streamed answer's first chunk waited for the client's delayed ACK, ~40 ms on every request
    after the first on a keep-alive connection (measured with httpx against the built-in worker:
    the first text 44 ms after the request, 4.5 ms on a fresh connection)."""
    async def accepted() -> int:
        sock = listen("127.0.0.1", 0, "test")
        seen: list[int] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            await asyncio.wait_for(reader.read(), 60)  # the handler has run and closed it
            writer.close()
        return seen[0]

    assert asyncio.run(accepted()) != 0

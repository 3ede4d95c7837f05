"""A client that leaves: a handler that awaits something long for it learns that it left.

Starlette notices a client that left only while it sends a streamed answer. A handler that
awaits something long before it answers (the engine's answer not streamed, which is sent whole
at its end; the proxy's wait for it) would otherwise have it made, to the last of max_tokens,
for nobody. `request.is_disconnected()` does not do here: behind an `@app.middleware("http")`
(the worker's token check, the service's guard) it never says so.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import anyio
from fastapi import Request


async def unless_left(request: Request, answer: Awaitable[Any]) -> tuple[Any, bool]:
    """What `answer` gives, and whether the client left meanwhile. Once it has, `answer` is
    cancelled and gives None, but a thread it waits on is waited for, and gives what it gives.
    Call it once the request's body is read."""
    got, error, left = None, None, False
    async with anyio.create_task_group() as group:
        async def watch() -> None:  # the body is read: what the server receives now is the disconnect
            nonlocal left
            while (await request.receive())["type"] != "http.disconnect":
                pass
            left = True
            group.cancel_scope.cancel()
        group.start_soon(watch)
        try:
            got = await answer
        except Exception as e:  # raised from here, anyio would wrap it in an ExceptionGroup
            error = e
        group.cancel_scope.cancel()
    if error is not None:
        raise error
    return got, left

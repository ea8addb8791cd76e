"""`EventStreamResponse`: server-sent events from an async generator, closed however it ends.

The generator is always closed (`aclose`) when the response ends: finished, failed, or the
client disconnected (an `http.disconnect` message, or a send that fails). Closing it is what
cancels a request's decode, so this is done here rather than left to garbage collection.
Server shutdown does not cut a stream: uvicorn lets running responses finish.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def event(data: Any) -> bytes:
    """One `data:` event: a JSON object, or the raw bytes given."""
    if isinstance(data, bytes):
        return data
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[Any], *, headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def listen_for_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                async def stream() -> None:
                    try:
                        await send({"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
                        async for data in self.events:
                            await send({"type": "http.response.body", "body": event(data),
                                        "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    except OSError:  # the client went away (ASGI 2.4 servers raise on send)
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(listen_for_disconnect)
                tg.start_soon(stream)
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()  # type: ignore[attr-defined]

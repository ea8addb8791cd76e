"""`create_app`: the FastAPI application over one loaded `Model`.

    POST /v1/chat/completions   messages through the model's chat format; stream or not
    POST /v1/completions        a prompt string or a list of token ids; stream or not
    GET  /v1/models             the one model served
    GET  /health                200 {"status": "ok", ...} while the server runs (with the
                                process id: behind Ray Serve, which replica answered)
    GET  /metrics               Prometheus text (see metrics.py)

Request bodies are read as raw JSON and checked by `protocol` (OpenAI's error shape, with the
field, the value and what is allowed) before anything is queued. Every error a client sees is
`{"error": {"message", "type", "param", "code"}}`; a failure of the server itself is logged with
its traceback and answered with a generic 500, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ModelBusyError, OrtspecError
from ..model import Model
from .engine import Engine, Outcome, Piece, QueueFull, Ticket
from .protocol import (
    ApiError,
    GenerationRequest,
    ModelInfo,
    ResponseIds,
    chunk,
    invalid,
    parse_chat,
    parse_completion,
    response_body,
    speculative_section,
    usage_chunk,
)
from .sse import DONE, EventStreamResponse

log = logging.getLogger("ortspec.serve")
T = TypeVar("T")
RETRY_AFTER_SECONDS = 1


def _runtime_error(e: OrtspecError) -> ApiError:
    """ortspec's own errors: a request the model refused (400), or no free slot (503)."""
    if isinstance(e, ModelBusyError):
        return ApiError(503, str(e), type="server_busy", code="model_busy",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return ApiError(400, str(e), code=type(e).__name__)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(None, f"the request body is not valid JSON: {e}") from None


def create_app(model: Model, *, model_name: str, drafter: str = "auto",
               max_concurrent: int = 4, max_queue: int = 64) -> FastAPI:
    if drafter == "auto":  # the responses name the drafter that runs
        drafter = model.default_drafter
    engine = Engine(model, drafter=drafter, max_concurrent=max_concurrent, max_queue=max_queue)
    info = ModelInfo.of(model, name=model_name)
    served_since = int(time.time())  # /v1/models' `created`: when this server took the model

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.close()  # running decodes have finished: uvicorn waited for their responses

    app = FastAPI(title="ortspec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        err = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code)
        return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error answering %s %s", request.method, request.url.path)
        err = ApiError(500, "internal server error", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "running": engine.admission.running,
                "waiting": engine.admission.waiting, "pid": os.getpid()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": served_since,
                                            "owned_by": "ortspec",
                                            "max_model_len": info.capacity}]}

    async def generate(request: Request, parse: Callable[[Any, ModelInfo], GenerationRequest]
                       ) -> Response:
        arrived = time.perf_counter()
        req = parse(await _json_body(request), info)
        try:
            ticket = engine.admit()
        except QueueFull as e:
            raise ApiError(503, f"the server is busy: {e}; retry later", type="server_busy",
                           code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        ids = ResponseIds(req.kind, model_name)
        if req.stream:
            return EventStreamResponse(_stream(engine, req, ticket, arrived, ids, drafter))
        try:
            body = await _unless_disconnected(
                request, _complete(engine, req, ticket, arrived, ids, drafter))
        except OrtspecError as e:
            raise _runtime_error(e) from None
        if body is None:  # nobody is listening; the decode stopped and gave its slot back
            return Response(status_code=499)
        return JSONResponse(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion)

    return app


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client disconnected first: then `work` is cancelled
    (waiting for a place, it leaves the queue; decoding, its worker stops after the step in
    progress). The request body has been read, so the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # its cleanup (the cancel flag, the admission place) has run
            log.info("client disconnected: %s %s cancelled", request.method, request.url.path)
    if task.cancelled():
        return None
    return task.result()


async def _complete(engine: Engine, req: GenerationRequest, ticket: Ticket, arrived: float,
                    ids: ResponseIds, drafter: str) -> dict[str, Any]:
    outcome: Outcome | None = None
    events = engine.run(req, ticket, arrived)
    try:
        async for item in events:  # not streamed: only the outcome, with the text
            outcome = item
    finally:
        await events.aclose()
        ticket.abandon()
    assert isinstance(outcome, Outcome) and outcome.text is not None
    return response_body(ids, outcome.text, outcome.finish_reason, len(req.prompt_ids),
                         outcome.completion_tokens,
                         speculative_section(outcome.counters, drafter))


async def _stream(engine: Engine, req: GenerationRequest, ticket: Ticket, arrived: float,
                  ids: ResponseIds, drafter: str) -> AsyncIterator[Any]:
    """The SSE events of one streamed request: OpenAI's chunks, then `[DONE]`."""
    events = engine.run(req, ticket, arrived)
    usage = req.include_usage
    try:
        if req.kind == "chat":
            yield chunk(ids, text="", role=True, include_usage=usage)
        async for item in events:
            if isinstance(item, Piece):
                yield chunk(ids, text=item.text, include_usage=usage)
                continue
            spec = speculative_section(item.counters, drafter)
            yield chunk(ids, reason=item.finish_reason, include_usage=usage,
                        extra={"speculative": spec})
            if usage:
                yield usage_chunk(ids, len(req.prompt_ids), item.completion_tokens, spec)
    except OrtspecError as e:  # the response has started: the error is the stream's last event
        yield _runtime_error(e).body()
    except Exception:  # noqa: BLE001 - logged here; the client gets no traceback
        log.exception("internal error in a streamed request")
        yield ApiError(500, "internal server error", type="server_error").body()
    finally:
        await events.aclose()
        ticket.abandon()
    yield DONE

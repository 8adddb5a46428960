"""The node's FastAPI app: OpenAI routes, health, metrics, debug, and OpenAI-style errors.

`build_app()` makes an app whose lifespan starts the `AsyncLLM` (and so the EngineCore
process) and shuts it down with the server. Every error leaves as
`{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status. A client that
disconnects aborts its request in the engine, streaming or not.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope, Send

from engine.async_llm import AsyncLLM, RequestFailedError
from engine.config import EngineConfig
from engine.core_client import EngineDeadError
from engine.errors import InvalidRequestError
from engine.messages import EngineAddresses
from engine.serving.metrics import NodeMetrics
from engine.serving.openai_serving import ModelNotFoundError, OpenAIServing
from engine.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
T = TypeVar("T")


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


class BodySizeLimitMiddleware:
    """413 for a request body over `max_bytes`, by Content-Length or as it streams in."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._drain(receive)
            await self._reject(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, f"request body exceeds {self.max_bytes} bytes")
            return msg

        await self.app(scope, limited_receive, send)

    async def _drain(self, receive: Receive) -> None:
        # Reading the rest lets the client finish sending and see the 413 cleanly.
        while (msg := await receive())["type"] == "http.request" and msg.get("more_body"):
            pass

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = error_response(
            413, f"request body exceeds {self.max_bytes} bytes", code="body_too_large"
        )
        await resp(scope, receive, send)


class AbortOnDisconnectResponse(StreamingResponse):
    """SSE response that notices a client disconnect while waiting for the next token.

    On disconnect the streaming task is cancelled and the body iterator closed, which runs
    the generator's `finally`: the request is aborted in the engine.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-write
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; cancel it (None) if the client disconnects first."""
    result: list[T] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            result.append(await work)
            tg.cancel_scope.cancel()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(watch)
    return result[0] if result else None


def build_app(
    config: EngineConfig,
    addresses: EngineAddresses,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    model_name = served_model_name or config.model.model

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        llm = AsyncLLM(config, addresses)
        metrics = NodeMetrics()
        llm.client.on_batch = lambda batch: metrics.update_engine(batch.stats)
        app.state.llm = llm
        app.state.metrics = metrics
        app.state.serving = OpenAIServing(llm, metrics, model_name, config.kv_transfer)
        try:
            await llm.start()
            logger.info("serving %s (max_model_len=%d)", model_name, llm.max_model_len)
            yield
        finally:
            await llm.shutdown()

    app = FastAPI(title="pdserve node", lifespan=lifespan)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    _add_error_handlers(app)

    @app.get("/health")
    async def health(request: Request) -> Response:
        dead = request.app.state.llm.client.dead
        if dead is not None:
            return error_response(503, dead, "server_error", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        return ModelList(
            data=[ModelCard(id=model_name, max_model_len=request.app.state.llm.max_model_len)]
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = request.app.state
        try:
            with anyio.fail_after(5):
                state.metrics.update_engine(await state.llm.get_stats())
        except (TimeoutError, EngineDeadError):
            pass  # serve the last stats seen
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/debug/engine")
    async def debug_engine(request: Request) -> JSONResponse:
        llm: AsyncLLM = request.app.state.llm
        violation = await llm.check_integrity()
        stats = await llm.get_stats()
        return JSONResponse(
            {
                "stats": {f: getattr(stats, f) for f in stats.__struct_fields__},
                "integrity": {"ok": violation is None, "error": violation},
            }
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving: OpenAIServing = request.app.state.serving
        p = serving.prepare_completion(body)
        if body.stream:
            return AbortOnDisconnectResponse(
                serving.stream_completion(p, body.include_usage), media_type="text/event-stream"
            )
        g = await until_disconnect(request, serving.collect(p))
        if g is None:
            return Response(status_code=499)
        return JSONResponse(serving.completion_response(p, g).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        serving: OpenAIServing = request.app.state.serving
        p = serving.prepare_chat(body)
        if body.stream:
            return AbortOnDisconnectResponse(
                serving.stream_chat(p, body.include_usage), media_type="text/event-stream"
            )
        g = await until_disconnect(request, serving.collect(p))
        if g is None:
            return Response(status_code=499)
        return JSONResponse(serving.chat_response(p, g).model_dump())

    return app


def _param_name(loc: tuple) -> str | None:
    """`("body", "messages", 0, "content", "str")` -> `"messages.0.content"`.

    Drops "body" and the names pydantic gives union members (types, not fields).
    """
    parts = []
    for x in loc:
        if isinstance(x, int):
            parts.append(str(x))
        elif x != "body" and x.isidentifier() and x.islower() and x not in _TYPE_NAMES:
            parts.append(x)
    return ".".join(parts) or None


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            return error_response(400, f"the request body is not valid JSON: {detail}")
        param = _param_name(err.get("loc", ()))
        return error_response(
            400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param=param
        )

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(ModelNotFoundError)
    async def model_not_found(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        return error_response(404, str(exc), param="model", code="model_not_found")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), "server_error", code="engine_dead")

    @app.exception_handler(RequestFailedError)
    async def request_failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(500, str(exc), "server_error", code="engine_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = "body_too_large" if exc.status_code == 413 else None
        return error_response(exc.status_code, str(exc.detail), code=code)

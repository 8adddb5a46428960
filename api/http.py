"""HTTP plumbing every pdserve server shares: OpenAI-style error bodies and handlers,
a request-body size limit, streaming that aborts on client disconnect.

Every error leaves as `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx
status, whether it comes from a node or from the router.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope, Send

from pdserve.api.body_deadline import BodyTimeout, body_timeout_response
from pdserve.api.protocol import ErrorInfo, ErrorResponse
from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_rules import ascii_int

DEFAULT_MAX_BODY_BYTES = 4 << 20
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,96}")
T = TypeVar("T")


def trace_id(headers) -> str | None:
    """The request's trace id: `X-Request-Id` (if sane: 1-96 of [A-Za-z0-9._:-]), with
    `.N` appended for `X-Attempt: N` > 0 (a router's retry). None if no usable header."""
    given = headers.get("x-request-id")
    if not given or not _REQUEST_ID.fullmatch(given):
        return None
    attempt = ascii_int(headers.get("x-attempt", "0")) or 0
    if 0 < attempt < 100:
        return f"{given}.{attempt}"
    return given


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
        async def stream() -> None:
            try:
                await self.stream_response(send)
            except OSError:
                pass  # the client went away mid-write

        try:
            await _first_of(stream(), self.listen_for_disconnect(receive))
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; cancel it (None) if the client disconnects first.

    An exception `work` raises is raised as itself, so the app's exception handlers see
    it."""
    task = asyncio.ensure_future(work)
    await _first_of(task, _wait_disconnect(request))
    return None if task.cancelled() else task.result()


async def _first_of(main: Awaitable, watch: Awaitable) -> None:
    """Run both until either ends, then cancel the other and wait for it. Plain asyncio
    tasks (no task group: anyio's cancel scopes cost CPU on every request of the router's
    hot path). An exception of `main` is raised as itself; if this coroutine is
    cancelled, both are cancelled and awaited first."""
    tasks = (asyncio.ensure_future(main), asyncio.ensure_future(watch))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:  # their cleanup (closing a node connection, ...) finishes first
            await asyncio.wait(pending)
    for t in tasks:
        error = None if t.cancelled() else t.exception()
        if error is not None and t is tasks[0]:
            raise error


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


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI-style bodies for invalid JSON, schema violations, bad values and HTTP errors."""

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            return error_response(400, f"the request body is not valid JSON: {detail}")
        param = _param_name(err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            return error_response(
                400,
                f"unknown or unsupported field {param!r}: this server does not honour it",
                param=param,
                code="unsupported_field",
            )
        return error_response(
            400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param=param
        )

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if isinstance(exc, BodyTimeout):
            return body_timeout_response(str(exc.detail))
        code = "body_too_large" if exc.status_code == 413 else None
        return error_response(exc.status_code, str(exc.detail), code=code)

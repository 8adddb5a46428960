"""One deadline for reading a whole request body, on every path that reads one.

A client that sends the headers and then stalls or trickles the body would otherwise
hold its connection and a server task forever. `BodyDeadlineMiddleware` (outermost, on
the node and in front of the router's lean path) times the `receive` calls made while
the body is incomplete, counting from when the request reached the app; past the
deadline the call raises `BodyTimeout`, an HTTP 408 that FastAPI's body reading passes
through to the app's handlers (api/http.py) and that the middleware itself answers when
it reaches it first (the lean path, the 413 drain). Either way the client gets the same
OpenAI-style body (`body_timeout_response`) and the connection is closed; no node or
engine is touched, since the body never finished.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.api.protocol import ErrorInfo, ErrorResponse

DEFAULT_BODY_TIMEOUT_S = 30.0
logger = logging.getLogger(__name__)


class BodyTimeout(HTTPException):
    """The request body did not arrive in full within the deadline."""

    def __init__(self, timeout_s: float):
        super().__init__(408, body_timeout_message(timeout_s))


def body_timeout_message(timeout_s: float) -> str:
    return f"the request body did not arrive within {timeout_s:g} s"


def body_timeout_response(message: str) -> JSONResponse:
    """The 408 every server sends (closes the connection: the body never finished)."""
    body = ErrorResponse(
        error=ErrorInfo(
            message=message, type="invalid_request_error", param=None, code="body_timeout"
        )
    )
    return JSONResponse(body.model_dump(), status_code=408, headers={"Connection": "close"})


class BodyDeadlineMiddleware:
    """Times the body `receive`s of every HTTP request (see the module docstring)."""

    def __init__(self, app: ASGIApp, timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        complete = False
        started = False

        async def timed_receive() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            left = deadline - loop.time()
            if left <= 0:
                raise BodyTimeout(self.timeout_s)
            try:  # asyncio.timeout: a timer on this task, no task per receive
                async with asyncio.timeout(left):
                    msg = await receive()
            except TimeoutError:
                raise BodyTimeout(self.timeout_s) from None
            if msg["type"] != "http.request" or not msg.get("more_body"):
                complete = True
            return msg

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, timed_receive, watched_send)
        except BodyTimeout as e:
            logger.info("%s %s: %s", scope["method"], scope["path"], e.detail)
            if not started:
                await body_timeout_response(e.detail)(scope, receive, send)

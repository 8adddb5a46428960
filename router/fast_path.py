"""The lean path of the router's two generation routes (`POST /v1/completions`,
`POST /v1/chat/completions`): plain ASGI in front of FastAPI.

FastAPI's request path (its middleware stack, routing, dependency solving, the stdlib
JSON parse and the body's re-validation) cost the router more CPU per request than the
routing itself. Here the body is read once, parsed with msgspec and validated by the same
pydantic model the FastAPI route declares (api/protocol.py), and the request goes
straight to `RouterServing`. Anything this path does not handle the usual way goes to
the FastAPI app unchanged, with the body it already read replayed, so every error body
stays exactly the node's:

- a body that is not a JSON object msgspec parses, or that the model rejects (the FastAPI
  route then produces the 400 from the same model);
- no or a non-JSON `Content-Type`, no `Content-Length` (chunked), or one over the body
  limit (the 413 of `BodySizeLimitMiddleware`).

A body that does not arrive in full within `body_timeout_s` (the `receive` the router's
`BodyDeadlineMiddleware` times raises `BodyTimeout`) gets the node's 408 here, sent
through the counting `send`.

Errors the serving layer raises (bad prompt, unknown model, no node, token limits) get the
responses of the app's exception handlers (`error_for`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.api.body_deadline import BodyTimeout, body_timeout_response
from pdserve.api.http import error_response
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.router.client_watch import ClientWatch
from pdserve.router.streamed import WATCH

logger = logging.getLogger(__name__)

ROUTES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}

_decode = msgspec.json.Decoder(dict).decode


class FastGeneration:
    """`__call__` serves one generation request; `slow` is the FastAPI app (for what this
    path leaves to it); `error_for(exc)` maps a serving exception to its error response
    (None: not one of them)."""

    def __init__(
        self,
        slow: ASGIApp,
        max_body_bytes: int,
        error_for: Callable[[Exception], Response | None],
    ):
        self.slow = slow
        self.max_body_bytes = max_body_bytes
        self.error_for = error_for

    def handles(self, scope: Scope) -> bool:
        return scope["method"] == "POST" and scope["path"] in ROUTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = content_type = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"content-type":
                content_type = value
        if (
            length is None
            or not length.isdigit()
            or int(length) > self.max_body_bytes
            or not _is_json(content_type)
        ):
            await self.slow(scope, receive, send)
            return
        try:
            body = await _read_body(receive)
        except BodyTimeout as e:
            await body_timeout_response(str(e.detail))(scope, receive, send)
            return
        if body is None:  # the client left while sending
            return
        model = ROUTES[scope["path"]]
        req = parse(model, body)
        if req is None:
            await self.slow(scope, _replay(body, receive), send)
            return
        request = Request(scope, receive)
        serving = scope["app"].state.serving
        watch = scope[WATCH] = ClientWatch(receive)
        try:
            try:
                if model is ChatCompletionRequest:
                    tokens = await serving.chat_tokens(req)
                    resp = await serving.handle(
                        "chat", req, [tokens], req.requested_max_tokens, request
                    )
                else:
                    prompts = await serving.completion_prompts(req)
                    # max_tokens 0 (echo only) is checked as 1, as on a node
                    resp = await serving.handle(
                        "completions", req, prompts, req.max_tokens or None, request
                    )
            except Exception as e:
                resp = self.error_for(e)
                if resp is None:
                    logger.exception("request failed")
                    resp = error_response(500, "internal error in the router", "server_error")
            await resp(scope, receive, send)
        finally:
            watch.close()


def parse(model: type[BaseModel], body: bytes) -> BaseModel | None:
    """The request, or None if the body is not a JSON object or the model rejects it (or
    anything else goes wrong: msgspec raises RecursionError on deep nesting, where the
    stdlib parser gives FastAPI's 400)."""
    try:
        return model.model_validate(_decode(body))
    except Exception:
        return None


def _is_json(content_type: bytes | None) -> bool:
    """As FastAPI decides whether to parse a body as JSON (absent counts as JSON)."""
    if content_type is None:
        return True
    main = content_type.split(b";", 1)[0].strip().lower()
    return main == b"application/json" or (
        main.startswith(b"application/") and main.endswith(b"+json")
    )


async def _read_body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` that first gives the body already read, then the client's messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

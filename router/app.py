"""The router's FastAPI app: OpenAI routes, health, models, cluster view, metrics.

`build_app()` makes an app whose lifespan loads the tokenizer, starts the membership
tasks (registry reads, health probes) and closes every node client on shutdown. Errors
leave with the same OpenAI-style bodies a node sends (api/http.py). With `api_key` set,
every `/v1/` route and what shows the cluster (`/cluster`, `/metrics`, `/debug/`) wants
`Authorization: Bearer <key>`; only `/health` stays open. Limits per client (`client_key`: the
authenticated key, else the address):
concurrent generation requests (`AuthAndCount`) and prompt tokens (router/token_budget.py).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.api.body_deadline import BodyDeadlineMiddleware
from pdserve.api.http import BodySizeLimitMiddleware, add_error_handlers, error_response
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from pdserve.common.errors import InvalidRequestError
from pdserve.common.redis_auth import redact
from pdserve.router.config import RouterConfig
from pdserve.router.fast_path import FastGeneration
from pdserve.router.membership import Membership
from pdserve.router.metrics import RouterMetrics
from pdserve.router.nodes import ClusterView
from pdserve.router.selector import Selector
from pdserve.router.serving import ModelNotFoundError, NoNodeError, RouterServing
from pdserve.router.token_budget import CLIENT_SCOPE_KEY, TokenLimitExceeded, client_key
from pdserve.router.tokenizer import RouterTokenizer, load_router_tokenizer, resolve_model_dir

logger = logging.getLogger(__name__)


def build_app(config: RouterConfig, tokenizer: RouterTokenizer | None = None) -> FastAPI:
    """The router app. `tokenizer` None: resolve `config.name` and load its tokenizer."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tok = tokenizer
        if tok is None:
            model_dir = await asyncio.to_thread(resolve_model_dir, config.name)
            tok = await asyncio.to_thread(load_router_tokenizer, model_dir)
        view = ClusterView(config)
        membership = Membership(config, view)
        metrics = RouterMetrics()
        app.state.view, app.state.membership, app.state.metrics = view, membership, metrics
        app.state.serving = RouterServing(config, Selector(config, view, membership), tok, metrics)
        await membership.start()
        watch = asyncio.create_task(app.state.serving.watch.run(), name="stream-watch")
        # What startup made (modules, schemas, the tokenizer) lives as long as the process:
        # out of the collector's sight, so that an occasional full collection does not walk
        # it (~0.1 s every ~2,000 requests before, a latency spike for the requests it hit).
        gc.collect()
        gc.freeze()
        logger.info(
            "router for %s: %d nodes known, Redis %s",
            config.api_name,
            len(view.nodes),
            "up" if membership.redis_ok else ("down" if config.redis_url else "not used"),
        )
        try:
            yield
        finally:
            watch.cancel()
            await membership.stop()
            await view.aclose()

    app = RouterApp(title="pdserve router", lifespan=lifespan)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_body_bytes)
    _add_error_handlers(app)
    app.fast = FastGeneration(app.fastapi, config.max_body_bytes, error_for)
    app.front = BodyDeadlineMiddleware(
        AuthAndCount(app.dispatch, config.api_key, config.max_concurrent_per_key),
        config.body_timeout_s,
    )

    def usable_decode(request: Request) -> int:
        return len(request.app.state.view.usable(True))

    @app.get("/health")
    async def health(request: Request) -> Response:
        if usable_decode(request) == 0:
            return error_response(503, "no usable decode node", "server_error", code="no_nodes")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        lens = [n.record.max_model_len for n in request.app.state.view.usable(True)]
        return ModelList(
            data=[ModelCard(id=config.api_name, max_model_len=min(lens, default=None))]
        )

    @app.get("/cluster")
    async def cluster(request: Request) -> JSONResponse:
        state = request.app.state
        return JSONResponse(
            {
                "model": config.api_name,
                "redis": {"url": redact(config.redis_url), "up": state.membership.redis_ok},
                "policies": {"prefill": config.prefill_policy, "decode": config.decode_policy},
                "nodes": [n.summary() for n in state.view.nodes.values()],
            }
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = request.app.state
        m: RouterMetrics = state.metrics
        m.usable_nodes.labels(role="decode").set(usable_decode(request))
        m.usable_nodes.labels(role="prefill").set(len(state.view.usable(False)))
        m.redis_up.set(1 if state.membership.redis_ok else 0)
        return Response(m.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving: RouterServing = request.app.state.serving
        prompts = await serving.completion_prompts(body)
        # max_tokens 0 (echo only) is checked as 1, as on a node
        return await serving.handle("completions", body, prompts, body.max_tokens or None, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        serving: RouterServing = request.app.state.serving
        tokens = await serving.chat_tokens(body)
        return await serving.handle("chat", body, [tokens], body.requested_max_tokens, request)

    return app


class RouterApp(FastAPI):
    """FastAPI, behind `AuthAndCount`, with the generation routes on the lean path
    (router/fast_path.py); everything else (and what the lean path leaves) is FastAPI's."""

    fast: FastGeneration
    front: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.fastapi(scope, receive, send)
            return
        scope["app"] = self
        await self.front(scope, receive, send)

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.fast.handles(scope):
            await self.fast(scope, receive, send)
        else:
            await self.fastapi(scope, receive, send)

    async def fastapi(self, scope: Scope, receive: Receive, send: Send) -> None:
        await FastAPI.__call__(self, scope, receive, send)


class AuthAndCount:
    """Bearer-key check on every route but `/health`; counts generation requests by final
    status; with `max_concurrent` > 0, a client (`client_key`: the key once checked, else
    its address) with that many generation requests in flight gets a 429 for the next one.

    Plain ASGI (no BaseHTTPMiddleware), so streamed responses and client disconnects pass
    through untouched.
    """

    def __init__(self, app, api_key: str | None, max_concurrent: int = 0):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_concurrent = max_concurrent
        self.in_flight: dict[bytes, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(path)
        if self.expected is not None and path != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                if route is not None:
                    scope["app"].state.serving.count(route, 401)
                resp = error_response(401, "invalid or missing API key", code="invalid_api_key")
                await resp(scope, receive, send)
                return
            scope[CLIENT_SCOPE_KEY] = b"key"  # the one configured key: one identity
        if route is None:
            await self.app(scope, receive, send)
            return
        client = client_key(scope)
        if self.max_concurrent and self.in_flight.get(client, 0) >= self.max_concurrent:
            scope["app"].state.serving.count(route, 429)
            msg = f"more than {self.max_concurrent} concurrent requests for this key"
            resp = error_response(429, msg, "rate_limit_error", code="rate_limit_exceeded")
            await resp(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                scope["app"].state.serving.count(route, message["status"])
            await send(message)

        self.in_flight[client] = self.in_flight.get(client, 0) + 1
        try:
            await self.app(scope, receive, counting_send)
        finally:
            left = self.in_flight.pop(client) - 1
            if left:
                self.in_flight[client] = left


def error_for(exc: Exception) -> Response | None:
    """The response to a request the serving layer refused (None: not a refusal)."""
    if isinstance(exc, InvalidRequestError):
        return error_response(400, str(exc), param=exc.param)
    if isinstance(exc, ModelNotFoundError):
        return error_response(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, NoNodeError):
        return error_response(503, str(exc), "server_error", code="no_nodes")
    if isinstance(exc, TokenLimitExceeded):
        resp = error_response(429, str(exc), "rate_limit_error", param="prompt", code=exc.code)
        if exc.retry_after_s is not None:
            resp.headers["Retry-After"] = str(exc.retry_after_s)
        return resp
    return None


def _add_error_handlers(app: FastAPI) -> None:
    add_error_handlers(app)

    async def refused(request: Request, exc: Exception) -> Response:
        return error_for(exc)

    for kind in (ModelNotFoundError, NoNodeError, TokenLimitExceeded):
        app.add_exception_handler(kind, refused)

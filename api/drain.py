"""Serve an app with a graceful drain on SIGTERM: finish in-flight, 503 for new, then exit.

`serve(app, ...)` runs uvicorn with this order on the first SIGTERM (or SIGINT):

1. the server keeps listening, but every new request (`/health` included, so the router
   and load balancers stop choosing this process) gets a 503 `draining` OpenAI-style body
   with `Connection: close`;
2. requests already in flight run to their end, for at most `drain_timeout_s` (a decode
   node hands the router's streams back at once, to migrate: node/resume.py; the app
   finds this middleware as `app.state.drain`);
3. then uvicorn shuts down (closing, within 1 s, anything still open) and the process
   exits. A second signal skips the wait.
"""

from __future__ import annotations

import logging
import threading
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.api.http import error_response

logger = logging.getLogger(__name__)


class DrainMiddleware:
    """Counts HTTP requests in flight; once `draining`, answers new ones with a 503."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.in_flight = 0
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            resp = error_response(
                503, "this server is draining; retry elsewhere", "server_error", code="draining"
            )
            resp.headers["connection"] = "close"
            await resp(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def serve(
    app: ASGIApp,
    *,
    host: str,
    port: int,
    log_level: str,
    drain_timeout_s: float,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
) -> None:
    """`ssl_certfile` and `ssl_keyfile` (PEM): serve HTTPS instead of HTTP."""
    import uvicorn

    drain = DrainMiddleware(app)
    state = getattr(app, "state", None)
    if state is not None:
        state.drain = drain
    config = uvicorn.Config(
        drain,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=1.0,  # the drain already waited for in-flight requests
        access_log=False,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
    )
    server = uvicorn.Server(config)
    plain_exit = server.handle_exit

    def handle_exit(sig, frame) -> None:
        if drain.draining:  # a second signal: stop waiting
            plain_exit(sig, frame)
            return
        drain.draining = True
        logger.info("draining: %d requests in flight, new ones get 503", drain.in_flight)

        def wait_then_exit() -> None:
            deadline = time.monotonic() + drain_timeout_s
            while drain.in_flight > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            if drain.in_flight:
                logger.warning("drain timeout: %d requests still in flight", drain.in_flight)
            plain_exit(sig, frame)

        threading.Thread(target=wait_then_exit, daemon=True).start()

    server.handle_exit = handle_exit  # type: ignore[method-assign]
    server.run()

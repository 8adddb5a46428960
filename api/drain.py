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

A stop has a deadline too: `exit_margin_s` past the drain, a process still running (a
shutdown step that hangs: a client library's close, a thread the interpreter waits for)
writes every thread's stack to stderr (its log) and ends with `exit_code()`, so whatever
supervises it (the launcher, systemd, Kubernetes) can start a fresh one. `kill -USR1 PID`
writes the same stacks without stopping anything (pdserve/common/stack_dump.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.api.http import error_response
from pdserve.common.stack_dump import dump_stacks

logger = logging.getLogger(__name__)

# After the drain: uvicorn's shutdown (1 s), the app's (a node stops its engine: up to ~7 s,
# and leaves the registry: up to ~3 s), then the interpreter's.
EXIT_MARGIN_S = 15.0
EXIT_STUCK = 1  # the exit code of a stop that overran its deadline, unless told otherwise


class DrainMiddleware:
    """Counts HTTP requests in flight; once `draining`, answers new ones with a 503."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.in_flight = 0
        self.draining = False
        # `serve` sets it: drain and stop as on SIGTERM, but `serve` then returns (no
        # signal raised again), so the process exits with the code its caller chooses
        self.stop: Callable[[], None] | None = None

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
    exit_margin_s: float = EXIT_MARGIN_S,
    exit_code: Callable[[], int] = lambda: EXIT_STUCK,
) -> None:
    """`ssl_certfile` and `ssl_keyfile` (PEM): serve HTTPS instead of HTTP. Once stopping,
    the process ends by `drain_timeout_s + exit_margin_s` whatever still runs (with
    `exit_code()` if it must be forced)."""
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

    def begin(sig: int | None, frame) -> None:
        """The drain, on a signal (`sig`) or asked from within (None: `drain.stop()`)."""
        if drain.draining:  # a second signal: stop waiting
            if sig is not None:
                plain_exit(sig, frame)
            return
        drain.draining = True
        logger.info("draining: %d requests in flight, new ones get 503", drain.in_flight)
        exit_by(drain_timeout_s + exit_margin_s, exit_code)

        def wait_then_exit() -> None:
            deadline = time.monotonic() + drain_timeout_s
            while drain.in_flight > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            if drain.in_flight:
                logger.warning("drain timeout: %d requests still in flight", drain.in_flight)
            if sig is None:  # no signal to hand back: `serve` returns, the caller exits
                server.should_exit = True
            else:  # uvicorn raises the signal again once it has shut down
                plain_exit(sig, frame)

        threading.Thread(target=wait_then_exit, daemon=True).start()

    drain.stop = lambda: begin(None, None)
    server.handle_exit = begin  # type: ignore[method-assign]
    server.run()


def exit_by(deadline_s: float, exit_code: Callable[[], int]) -> None:
    """End this process `deadline_s` from now if it is still running: every thread's stack
    and every asyncio task's to stderr first (where it hung), then `os._exit(exit_code())`.
    A daemon thread: a process that exits in time never notices it."""
    try:  # called on the event loop's thread (a signal handler, or the loop itself)
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None

    def run() -> None:
        time.sleep(deadline_s)
        code = exit_code()
        logger.error(
            "still running %.0f s after the stop began: every thread's and task's stack "
            "follows, then a forced exit (code %d)",
            deadline_s,
            code,
        )
        for h in logging.getLogger().handlers:
            h.flush()
        dump_stacks(loop)
        os._exit(code)

    threading.Thread(target=run, name="exit-deadline", daemon=True).start()

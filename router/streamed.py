"""How a relayed stream reaches the client, and one attempt's in-flight accounting.

`RelayResponse` writes the relayed events: on the lean path (router/fast_path.py) in the
request's own task under its `ClientWatch` (router/client_watch.py), elsewhere (the FastAPI
route) as `AbortOnDisconnectResponse`. `Relayed` wraps the relay generator so that closing
it releases the node connection and the attempt's accounting even if it never started.
`Release` undoes an attempt's in-flight counts exactly once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pdserve.api.http import AbortOnDisconnectResponse
from pdserve.router.client_watch import ClientWatch
from pdserve.router.relay import OpenStream
from pdserve.router.selector import Decision

WATCH = "pdserve.client_watch"  # the scope key of the lean path's ClientWatch


class RelayResponse(AbortOnDisconnectResponse):
    """The relayed stream: on the lean path, written in the request's own task under its
    `ClientWatch` (a disconnect cancels the write, and the relay closes); elsewhere as
    `AbortOnDisconnectResponse` (its own disconnect listener)."""

    async def __call__(self, scope, receive, send) -> None:
        watch: ClientWatch | None = scope.get(WATCH)
        if watch is None:
            await super().__call__(scope, receive, send)
            return
        try:
            await watch.run(self.stream_response(send))
        except OSError:
            pass  # the client went away mid-write
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class Relayed:
    """The relay generator, with a cleanup that runs on `aclose()` even if iteration never
    started (a client gone before the first write): the node connection is closed and the
    attempt's accounting released, exactly once."""

    def __init__(self, gen: AsyncIterator[bytes], opened: OpenStream, release: Release):
        self._gen, self._opened, self._release = gen, opened, release

    def __aiter__(self) -> Relayed:
        return self

    async def __anext__(self) -> bytes:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        finally:
            self._opened.close()
            self._release.all()


class Release:
    """Undo one attempt's in-flight accounting exactly once, in two steps."""

    def __init__(self, d: Decision):
        self.d = d
        self._prefill_out = d.prefill is not None
        self._done = False
        self.start = time.monotonic()

    def prefill_done(self) -> None:
        if self._prefill_out:
            self.d.prefill.prefill_blocks -= self.d.prompt_blocks
            self._prefill_out = False

    def all(self) -> None:
        self.prefill_done()
        if not self._done:
            self._done = True
            self.d.decode.inflight -= 1
            self.d.decode.inflight_blocks -= self.d.prompt_blocks

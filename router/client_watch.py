"""Client disconnects on the router's lean path: one watcher task per request.

A request that waits on a node (the JSON answer, a stream's first token, then the relay)
must stop when its client disconnects, so that the node connection closes and the node
aborts. `api/http.py` does that per phase: the phase runs as a task beside a task waiting
for the disconnect, and `asyncio.wait` takes the first (two tasks, two waits and a
cancellation per phase, three or four loop turns). On the router that cost more than the
routing decision, twice for a stream (up to its first token, then the relay).

`ClientWatch` runs each phase in the request's own task instead, and starts one watcher
for the whole request. Contract:

- `run(work)` awaits `work` (a coroutine) in the calling task and returns its result, or
  raises what it raised; if the client disconnects while `work` runs, `work` is cancelled
  where it waits (its `finally` and `except BaseException` cleanup runs, as with a
  cancelled task) and `run` returns None. A client already gone: `work` never starts.
- A disconnect between phases (no `run` in progress) cancels nothing; the next `run`
  returns None at once.
- A cancellation that does not come from this watch (server shutdown) is raised as usual.
- `close()` stops the watcher; call it when the request is done (idempotent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientWatch:
    def __init__(self, receive: Receive):
        self._receive = receive
        self._task = asyncio.current_task()
        self._watcher: asyncio.Task | None = None
        self._running = False  # a `run` is awaiting its work
        self._cancelled = False  # this watch cancelled the task
        self.gone = False  # the client disconnected

    async def run(self, work: Coroutine[Any, Any, T]) -> T | None:
        if self.gone:
            work.close()
            return None
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        self._running = True
        try:
            return await work
        except asyncio.CancelledError:
            if not self._cancelled:
                raise
            self._cancelled = False
            if self._task.uncancel() > 0:  # cancelled from outside as well
                raise
            return None
        finally:
            self._running = False

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._running:
            self._cancelled = True
            self._task.cancel()

    def close(self) -> None:
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()

"""Streams left on a node the router has taken out of service are cut, so they migrate.

A decode node that freezes or is cut off by the network keeps its TCP connections open: a
stream from it just stops, and the read deadline between two reads is the whole
`request_timeout_s`. The router already knows such a node is gone: its health probe fails,
its circuit breaker opens, or its engine is stuck. `StreamWatch` looks at every relayed
stream each `interval_s`; one whose node is out of service and that has been silent for
`router.migrate_silent_after_s` is cut (its connection aborted, the pending read fails),
and the relay moves it to another decode node (router/migration.py). A stream still
flowing is never cut, whatever the probes say: its node is alive for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pdserve.router.node_http import NodeHTTPError

if TYPE_CHECKING:
    from pdserve.router.migration import StreamRelay
    from pdserve.router.nodes import NodeState

logger = logging.getLogger(__name__)


def out_of_service(node: NodeState) -> str | None:
    """Why the router sends this node no work now, or None."""
    if not node.alive:
        return f"it failed its health probe ({node.last_error})"
    if node.stuck:
        return "its engine is stuck"
    if node.breaker.state != "closed":
        return "its circuit breaker is open"
    return None


class StreamWatch:
    def __init__(self, silent_after_s: float, interval_s: float = 0.5):
        self.silent_after_s = silent_after_s
        self.interval_s = interval_s
        self.relays: set[StreamRelay] = set()

    def check(self, now: float) -> int:
        """Cut the silent streams of nodes out of service; how many were cut."""
        cut = 0
        for relay in list(self.relays):
            opened, node = relay.reading, relay.node
            if opened is None or node is None or now - relay.last_read < self.silent_after_s:
                continue
            why = out_of_service(node)
            if why is None:
                continue
            silent = now - relay.last_read
            logger.warning(
                "request %s: no bytes from %s for %.1f s and %s: moving the stream",
                relay.ctx.rid, node.url, silent, why,
            )  # fmt: skip
            opened.response.abort(NodeHTTPError(f"silent for {silent:.1f} s while {why}"))
            relay.reading = None
            cut += 1
        return cut

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.check(time.monotonic())
            except Exception:  # noqa: BLE001 - a bug here must not stop the watch
                logger.exception("stream watch failed")

"""Stopping background tasks within a deadline.

`task.cancel(); await task` waits for as long as the task takes to honour the cancel, and
under Python 3.11 a task may never see it: `asyncio.wait_for` hides a cancel that lands
just as its inner future ends (CPython gh-86296, fixed in 3.12), and redis-py runs every
command it sends under `wait_for(..., socket_timeout)`. A registry heartbeat cancelled there
went on looping, the node's `await` never returned, and a node whose engine had died stayed
up for good instead of exiting to be restarted (a fault drill on CI; the old stop hung
within the 40 stops of tests/test_task_stop.py here). So a stop cancels, waits at most
`timeout_s`, and leaves behind what did not end; loops that must not go on past a stop
also check a flag of their own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout_s: float) -> list[asyncio.Task]:
    """Cancel every task and wait up to `timeout_s` for them to end. Returns those still
    running (left behind, logged); what the ended ones raised is consumed."""
    tasks = [t for t in tasks if not t.done()]
    for t in tasks:
        t.cancel()
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in done:
        if not t.cancelled():
            t.exception()  # retrieved: ending with an error is fine once stopping
    for t in pending:
        logger.warning(
            "task %s did not end within %g s of its cancel; left behind", t.get_name(), timeout_s
        )
    return sorted(pending, key=lambda t: t.get_name())

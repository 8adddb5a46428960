"""A spawned process that dies with its parent (the engine core, a tensor-parallel rank).

`PR_SET_PDEATHSIG` where Linux offers it, and a watchdog thread polling the parent pid
for the rest (and for a parent that died before prctl took effect).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        logger.debug("prctl unavailable; relying on the parent watchdog")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()

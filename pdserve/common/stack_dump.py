"""Where a process is: every thread's stack and every asyncio task's chain of awaits, to
stderr (a pdserve process's log). `pdserve` installs it on SIGUSR1 (`kill -USR1 PID` dumps
without stopping anything); a stop past its deadline dumps before its forced exit
(api/drain.py). A thread stack alone shows an event loop waiting in `select`: the task
chains show what each coroutine awaits."""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys


def dump_stacks(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Every thread's stack, then every task of `loop` (may be called from another thread:
    a race with the loop costs at most this dump)."""
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    if loop is not None:
        _print_tasks(loop)
    sys.stderr.flush()


def _print_tasks(loop: asyncio.AbstractEventLoop) -> None:
    try:
        tasks = list(asyncio.all_tasks(loop))
    except RuntimeError:  # the loop changed the set meanwhile
        return
    for t in tasks:
        print(f"asyncio task {t.get_name()} (outermost await first):", file=sys.stderr)
        aw = t.get_coro()
        while aw is not None:  # down the chain of awaits, to where it waits
            frame = getattr(aw, "cr_frame", None) or getattr(aw, "ag_frame", None)
            frame = frame or getattr(aw, "gi_frame", None)
            if frame is not None:
                code = frame.f_code
                print(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}',
                      file=sys.stderr)  # fmt: skip
            aw = getattr(aw, "cr_await", None) or getattr(aw, "ag_await", None)


def install_on_sigusr1() -> None:
    """SIGUSR1 dumps the stacks (tasks of the loop running on the main thread, if any)."""

    def handler(signum, frame) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        dump_stacks(loop)

    signal.signal(signal.SIGUSR1, handler)

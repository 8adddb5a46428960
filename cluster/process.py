"""One supervised OS process: spawned in its own process group with its output in a log
file, stopped as a group (SIGTERM, a grace period, then SIGKILL), so nothing it started
(an EngineCore process, a uvicorn worker) outlives it.

A child also gets `PR_SET_PDEATHSIG` (SIGTERM when the launcher dies, even by SIGKILL), so
a killed launcher leaves no orphans either. It fires when the spawning *thread* exits:
spawn only from a thread that lives as long as the process (the launcher's main thread).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own stop() still cleans up


def log_tail(path: str | Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class ManagedProcess:
    """A command with a log file; `start()` may be called again after it exited."""

    def __init__(self, argv: list[str], log_path: str | Path, env: dict[str, str] | None = None):
        self.argv = argv
        self.log_path = Path(log_path)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self._terminating = False  # SIGTERM sent: a second one would skip uvicorn's drain

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"==== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
            log.flush()
            self._terminating = False
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def poll(self) -> int | None:
        """None while running; the exit code once it has exited (it is then reaped)."""
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        """Signal the whole process group (the process and everything it started)."""
        if self.proc is None:
            return
        self._terminating |= sig == signal.SIGTERM
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the group, wait up to `grace_s`, then SIGKILL what is left."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            if not self._terminating:
                self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("pid %d did not stop in %.0f s: SIGKILL", self.proc.pid, grace_s)
        # Children in the group (an engine process) may outlive the leader: kill them too.
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            logger.error("pid %d survived SIGKILL", self.proc.pid)
        self._wait_group_gone(10.0)
        return self.proc.returncode

    def _wait_group_gone(self, timeout_s: float) -> None:
        """Wait until no process of the group is left (SIGKILL delivery is asynchronous)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)
        logger.error("process group %d still has members after SIGKILL", self.proc.pid)

    def tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

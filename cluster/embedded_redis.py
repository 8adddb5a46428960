"""An embedded `redis-server` for a local cluster and for tests.

`EmbeddedRedis` starts a real server on loopback, on a free port unless one is given, with
persistence off, and stops it (SIGTERM, then SIGKILL) on `stop()` or when used as a
context manager. The server is started with `--daemonize no` as a child process, so a
supervisor that owns it can also kill it by PID.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import time
from pathlib import Path

logger = logging.getLogger(__name__)


class RedisUnavailableError(RuntimeError):
    """redis-server is not installed, or did not start in time."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    """No listener on the port (connections of a stopped server in TIME_WAIT do not count:
    redis-server binds with SO_REUSEADDR, so a restart on the same port works)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


class EmbeddedRedis:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_file: str | Path | None = None,
        executable: str = "redis-server",
    ):
        self.host = host
        self.port = port or _free_port(host)
        self.log_file = Path(log_file) if log_file else None
        self.executable = executable
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        exe = shutil.which(self.executable)
        if exe is None:
            raise RedisUnavailableError(
                f"{self.executable} not found: install it (apt-get install redis-server)"
            )
        if self.ping() or not _port_free(self.host, self.port):
            raise RedisUnavailableError(f"port {self.port} on {self.host} is already in use")
        cmd = self.command(exe)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        finally:
            if self.log_file:
                out.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisUnavailableError(
                    f"redis-server exited with code {self.proc.returncode} on port {self.port}"
                )
            if self.ping():
                logger.info("embedded redis-server pid %d at %s", self.proc.pid, self.url)
                return self
            time.sleep(0.05)
        self.stop()
        raise RedisUnavailableError(f"redis-server did not answer on {self.url} in {timeout_s} s")

    def command(self, exe: str | None = None) -> list[str]:
        """The redis-server command line (a supervisor may run it itself)."""
        exe = exe or shutil.which(self.executable) or self.executable
        return [
            exe,
            "--bind", self.host,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--dir", "/tmp",
            "--dbfilename", f"pdserve-redis-{self.port}.rdb",
        ]  # fmt: skip

    def ping(self) -> bool:
        """True when the server answers PING (a raw RESP exchange, no client library)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

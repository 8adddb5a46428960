"""An embedded `redis-server` for a local cluster and for tests.

`EmbeddedRedis` starts a real server on loopback, on a free port unless one is given, with
persistence off, and stops it (SIGTERM, then SIGKILL) on `stop()` or when used as a
context manager. The server is started with `--daemonize no` as a child process, so a
supervisor that owns it can also kill it by PID.

With a `password` (a cluster with a secret: `pdserve.common.redis_auth.embedded_password`)
the server wants AUTH for every command; the password goes to redis-server in a config
file readable by the owner only (`conf_file`), never on its command line.
"""

from __future__ import annotations

import logging
import os
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
        password: str | None = None,
        conf_file: str | Path | None = None,
    ):
        """`conf_file`: where the password's config file goes (default: beside the log,
        else /tmp); written with mode 0600."""
        self.host = host
        self.port = port or _free_port(host)
        self.log_file = Path(log_file) if log_file else None
        self.executable = executable
        self.password = password or None
        if not password:
            conf_file = None  # an open server (loopback, no secret) needs no config file
        elif conf_file is None:
            folder = self.log_file.parent if self.log_file else Path("/tmp")
            conf_file = folder / f"pdserve-redis-{self.port}-{os.getpid()}.conf"
        self.conf_file = Path(conf_file) if conf_file else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Its URL, without the password (see `pdserve.common.redis_auth.with_password`)."""
        return f"redis://{self.host}:{self.port}"

    def write_conf(self) -> None:
        """The owner-only config file holding the password (created before it is written)."""
        if self.conf_file is None:
            return
        self.conf_file.unlink(missing_ok=True)
        fd = os.open(self.conf_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'requirepass "{self.password}"\n')

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
        self.write_conf()
        return [
            exe,
            *([str(self.conf_file)] if self.conf_file else []),
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
                if self.password:
                    pw = self.password.encode()
                    s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                    if not s.recv(64).startswith(b"+OK"):
                        return False
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if self.conf_file is not None:
            self.conf_file.unlink(missing_ok=True)
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

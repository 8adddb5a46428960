"""Start and inspect live `pdserve serve` processes for the HTTP-level tests."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def _worker_ports() -> range | None:
    """Under pytest-xdist, this worker's own slice of the ports from 20000 up to the
    kernel's ephemeral range (None otherwise, or where that range starts too low)."""
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if not worker or not count:
        return None
    try:
        top = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        top = 32768
    span = (min(top, 32768) - 20000) // int(count)
    if span < 200:
        return None
    lo = 20000 + int(worker.removeprefix("gw")) * span
    return range(lo, lo + span)


# from a random point: two test sessions at once on one box do not walk the same ports
_next_port = itertools.count(int.from_bytes(os.urandom(2), "big"))


def free_port() -> int:
    """A loopback port with nothing on it, for a server about to be started. Under
    pytest-xdist each worker takes its ports, in turn, from its own slice below the
    ephemeral range: a port picked here is then never handed out meanwhile, before the
    server binds it, to another worker's pick or to an outgoing connection (which take
    theirs from the ephemeral range). Otherwise the kernel picks one."""
    ports = _worker_ports()
    for _ in range(len(ports) if ports else 0):
        port = ports[next(_next_port) % len(ports)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or a closed connection's TIME_WAIT): the next one
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (two `free_port` calls may return the same one)."""
    ports: list[int] = []
    while len(ports) < n:
        if (p := free_port()) not in ports:
            ports.append(p)
    return ports


def descendants(pid: int) -> set[int]:
    """All live processes below `pid` (from /proc, so no extra dependency)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def engine_core_of(pid: int) -> int:
    """The EngineCore process of the node process `pid` (its multiprocessing-spawned child)."""
    for p in descendants(pid):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            return p
    raise AssertionError(f"process {pid} has no EngineCore child")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


_SETPRIV = shutil.which("setpriv")


def dies_with_test(cmd: list[str]) -> list[str]:
    """`cmd` run so that it gets SIGKILL when the test process that started it dies
    (util-linux `setpriv --pdeathsig`, where present): a test worker the OOM killer ends must
    not leave its servers or clusters running, holding gigabytes, under the next tests. A
    launcher's nodes die with it in turn (cluster/process.py). Only from the test's main
    thread: the signal follows the thread that started the process."""
    return [_SETPRIV, "--pdeathsig", "KILL", *cmd] if _SETPRIV else cmd


def launch_server(
    args: list[str], port: int, command: str = "serve"
) -> tuple[str, subprocess.Popen]:
    """Start `pdserve COMMAND ARGS --port PORT` (no wait); COMMAND is serve or router."""
    cmd = [sys.executable, "-m", "pdserve", command, "--port", str(port), *args]
    return f"http://127.0.0.1:{port}", subprocess.Popen(dies_with_test(cmd), cwd=ROOT)


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout_s: float = 300, poll_s: float = 0.5
) -> None:
    """Wait for the server's /health; one that is not healthy in time is killed (with its
    children), so that a failed fixture leaves no server behind for the rest of the run."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"server {url} exited with {proc.returncode}"
        if time.monotonic() >= deadline:
            kill_server(proc)
            raise AssertionError(f"server {url} not healthy in {timeout_s} s")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)


def start_server(args: list[str], command: str = "serve") -> tuple[str, subprocess.Popen]:
    url, proc = launch_server(args, free_port(), command)
    wait_healthy(url, proc)
    return url, proc


def kill_server(proc: subprocess.Popen) -> None:
    """SIGKILL the server and everything below it."""
    if proc.poll() is None:
        kids = descendants(proc.pid)
        proc.kill()
        proc.wait(30)
        for pid in kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def engine_state(url: str) -> dict:
    """The node's engine stats; asserts that its block pool invariants hold."""
    body = httpx.get(f"{url}/debug/engine", timeout=30).json()
    assert body["integrity"] == {"ok": True, "error": None}
    return body["stats"]


def wait_idle(url: str, timeout_s: float = 30) -> dict:
    """Wait until the node runs nothing and holds no block; returns its stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_state(url)
        busy = stats["num_running"] + stats["num_waiting"] + stats["kv_blocks_used"]
        if busy == 0 and stats.get("num_waiting_for_kv", 0) == 0:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        time.sleep(0.2)


def launcher_state(run_root: Path, cluster: str) -> dict:
    """`pdserve launch`'s cluster.json for `cluster` under `run_root` (no services until the
    launcher has written it)."""
    path = run_root / f"{cluster}-latest" / "cluster.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"services": []}

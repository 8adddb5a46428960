"""Checks the multi-host drills make besides the answers.

The bind check: every listener on every host, read with `ss` inside its namespace, sorted into ours (pdserve processes and Redis: on their host's
address only), Ray's (allowed on every address, but only on the ports
tests/multihost/cluster.py pins, since Ray 2.60 cannot confine them: docs/operations.md
"Multi-host"), and anything else (allowed on the host's address or loopback only).
Also: a node's log collected on the launcher's side, and a node's wall clock.
"""

from __future__ import annotations

import email.utils
import re
import time
from pathlib import Path

import httpx

from tests.multihost.cluster import RAY_PORT, RAY_PORTS, WORKER_PORTS
from tests.servers import descendants

RAY_PINNED = {RAY_PORT, *RAY_PORTS.values(), *range(WORKER_PORTS[0], WORKER_PORTS[1] + 1)}


def ray_process(pid: int, driver_pid: int | None = None) -> bool:
    """GCS, raylet, a Ray core worker (titled `ray::...`, or default_worker.py before it
    takes its title), the autoscaler monitor, or the Ray driver (`pdserve launch`)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return (
        pid == driver_pid
        or Path(argv[0].decode()).name in ("gcs_server", "raylet")
        or argv[0].startswith(b"ray::")
        or any(
            a.endswith((b"autoscaler/_private/monitor.py", b"workers/default_worker.py"))
            for a in argv
        )
    )


def check_binds(hosts, ours: set[int], driver_pid: int | None = None):
    """(seen, wrong, ray_any) per host: our listeners' addresses, the `ss` lines that
    break the rule, and Ray's wildcard listeners on pinned ports. `ours`: the pids of
    pdserve processes and Redis (their descendants are added)."""
    ours = ours | {d for p in ours for d in descendants(p)}
    seen, wrong, ray_any = {}, {}, {}
    for h in hosts.names:
        for line in hosts.check(h, ["ss", "-ltnupH"]).splitlines():
            addr = line.split()[4]
            pids = {int(p.split(",")[0]) for p in line.split("pid=")[1:]}
            if pids & ours:
                seen.setdefault(h, []).append(addr)
                if not addr.startswith(hosts.addr(h) + ":"):
                    wrong.setdefault(h, []).append(line)
            elif addr.startswith((hosts.addr(h) + ":", "127.0.0.1:", "[::1]:")):
                continue
            elif (
                all(ray_process(p, driver_pid) for p in pids)
                and int(addr.rsplit(":", 1)[1]) in RAY_PINNED
            ):
                ray_any.setdefault(h, []).append(addr)
            else:
                wrong.setdefault(h, []).append(line)
    return seen, wrong, ray_any


def assert_log_collected(c, node: str, pattern: str, timeout_s=10) -> None:
    """`node`'s log, written on its own host by the Ray actor's node process, is copied
    into the launcher's run directory: a line matching `pattern` shows up there."""
    svc = c.service(node)
    local = Path(svc["log"])
    assert c.run_root in local.parents, svc  # the launcher's run directory
    written = Path(f"/proc/{svc['pid']}/fd/1").resolve()  # where the node writes
    assert written != local.resolve() and written.name == "node.log", written
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, local.read_text(errors="replace") if local.exists() else ""):
        assert time.monotonic() < deadline, f"{local}: no {pattern!r} in {c.log(local.name)}"
        time.sleep(0.5)


def clock_skew(url: str) -> float:
    """How far the node's wall clock is from ours: its HTTP `Date` header."""
    date = httpx.get(f"{url}/health", timeout=10).headers["date"]
    return email.utils.parsedate_to_datetime(date).timestamp() - time.time()

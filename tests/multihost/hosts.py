"""N hosts on one machine: network namespaces on one bridge, each with its own address.

Host `h1..hN` is the namespace `<prefix>-h<i>`, joined to the bridge `<prefix>-br` by a veth
pair (`<prefix>-h<i>` on the bridge side, `eth0` inside), with the fixed address
`<subnet>.<10 + i>`; the bridge itself holds `<subnet>.1`, so the machine's own processes (a
test) reach every host; each host's default route points at the bridge, where the machine
(which forwards nothing) ends it. Each namespace's own
`lo` is up, so a process may still talk to itself on 127.0.0.1.

Faults: `cut(host)` sets the bridge side of the host's veth down (the host keeps its
address but no packet crosses, in either direction) and `heal(host)` sets it up again;
`rate(host, "10mbit")` puts a tbf qdisc on both ends of the veth; `run(..., clock_offset_s=)`
starts a process under `faketime`, so its wall clock is off by the offset (its monotonic
clock moves by the same constant, harmless: another host's monotonic clock has another
origin anyway; FAKETIME_DONT_FAKE_MONOTONIC=1 would keep it, but libfaketime 0.9.10 then
makes Python's `time.sleep` fail with EINVAL). Every process `run()` starts gets its own process group and is tracked; `down()`
ends them by process group, then every process still inside a namespace by PID, then
deletes the namespaces and the bridge. `up()` first removes whatever an earlier (crashed) run
with the same prefix left behind.

From a shell (root), for debugging:
    python -m tests.multihost.hosts up 3          # h1..h3 at 10.77.0.11..13
    python -m tests.multihost.hosts run h2 ip addr   # run [--clock-offset-s -10] HOST CMD
    python -m tests.multihost.hosts cut h2 | heal h2 | rate h2 10mbit | down
`--prefix`/`--subnet` (or PDSERVE_HOSTS_PREFIX / PDSERVE_HOSTS_SUBNET) pick another set.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PREFIX = os.environ.get("PDSERVE_HOSTS_PREFIX", "pdh")
DEFAULT_SUBNET = os.environ.get("PDSERVE_HOSTS_SUBNET", "10.77.0.0/24")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def faketime_env(offset_file: Path) -> dict[str, str]:
    """Environment that puts a process and everything it starts under libfaketime, its
    clock off by the offset written in `offset_file` (e.g. "+5h"), read once per process
    when it starts: rewriting the file shifts the processes started after, never the
    clock of one already running (a host's clock is off, it does not jump)."""
    libs = sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))
    if not libs:
        raise RuntimeError("libfaketime is missing (apt-get install faketime)")
    return {
        "LD_PRELOAD": str(libs[0]),
        "FAKETIME_TIMESTAMP_FILE": str(offset_file),
        "FAKETIME_CACHE_DURATION": str(10**9),  # read once: no jump in a running process
    }


def unavailable() -> str | None:
    """Why hosts cannot be made here (None when they can): root and `ip netns` are needed."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces)"
    if not shutil.which("ip"):
        return "the ip command (iproute2) is missing"
    probe = f"pdprobe{os.getpid()}"
    if sh("ip", "netns", "add", probe, check=False).returncode != 0:
        return "ip netns add fails here (no network namespace support)"
    sh("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class HostProcess:
    """A process started on a host; its own process group, ended by `stop()`."""

    host: str
    argv: list[str]
    popen: subprocess.Popen
    log: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout_s: float | None = None) -> int:
        return self.popen.wait(timeout_s)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM the group, then SIGKILL it after `grace_s`; reaps the leader."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return self.popen.returncode


@dataclass
class Hosts:
    n: int
    prefix: str = DEFAULT_PREFIX
    subnet: str = DEFAULT_SUBNET
    procs: list[HostProcess] = field(default_factory=list)

    def __post_init__(self):
        net = ipaddress.ip_network(self.subnet)
        assert net.num_addresses >= 16 + self.n, f"{self.subnet} is too small for {self.n} hosts"
        assert len(f"{self.prefix}-h{self.n}") <= 15, "interface names are at most 15 characters"
        self.net = net

    # -- names and addresses -------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [f"h{i}" for i in range(1, self.n + 1)]

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def gateway(self) -> str:
        """The bridge's address: where the machine itself is seen from the hosts."""
        return str(self.net.network_address + 1)

    def _index(self, host: str) -> int:
        assert host in self.names, f"no host {host!r} (hosts: {', '.join(self.names)})"
        return int(host[1:])

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def veth(self, host: str) -> str:
        """The bridge side of the host's link (the namespace side is its `eth0`)."""
        return f"{self.prefix}-{host}"

    def addr(self, host: str) -> str:
        return str(self.net.network_address + 10 + self._index(host))

    # -- lifecycle -----------------------------------------------------------------------
    def up(self) -> Hosts:
        clean_stale(self.prefix)
        plen = self.net.prefixlen
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/{plen}", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for host in self.names:
            ns, veth = self.ns(host), self.veth(host)
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", veth, "master", self.bridge)
            sh("ip", "link", "set", veth, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(host)}/{plen}", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            # A default route to the bridge: tools that find "my address" by routing to a
            # public one (Ray) get this host's. The machine forwards nothing, so no packet
            # leaves the bridge.
            sh("ip", "-n", ns, "route", "add", "default", "via", self.gateway)
        return self

    def down(self) -> None:
        for p in self.procs:
            p.stop(grace_s=3.0)
        self.procs.clear()
        clean_stale(self.prefix)

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- processes -----------------------------------------------------------------------
    def wrap(self, host: str, argv: list[str], clock_offset_s: float | None = None) -> list[str]:
        """`argv` as run on `host` (and with its wall clock off by `clock_offset_s`)."""
        cmd = ["ip", "netns", "exec", self.ns(host)]
        if clock_offset_s:
            cmd += ["faketime", "-f"]
            cmd += [f"{clock_offset_s:+g}s"]
        return cmd + list(argv)

    def run(
        self,
        host: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        log: str | Path | None = None,
        cwd: str | Path | None = None,
        clock_offset_s: float | None = None,
    ) -> HostProcess:
        """Start `argv` on `host` in its own process group (output to `log`, else dropped)."""
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        try:
            popen = subprocess.Popen(
                self.wrap(host, argv, clock_offset_s),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            if log:
                out.close()
        proc = HostProcess(host, list(argv), popen, Path(log) if log else None)
        self.procs.append(proc)
        return proc

    def check(self, host: str, argv: list[str], timeout_s: float = 30.0, **kw) -> str:
        """Run `argv` on `host` to completion; its stdout (raises on a non-zero exit)."""
        cmd = self.wrap(host, argv, kw.pop("clock_offset_s", None))
        return subprocess.run(
            cmd, capture_output=True, text=True, check=True, timeout=timeout_s, **kw
        ).stdout

    def pids(self, host: str) -> list[int]:
        """Every process inside the host's namespace."""
        out = sh("ip", "netns", "pids", self.ns(host), check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, host: str) -> list[int]:
        """SIGKILL every process of the host (the host is lost); returns their pids."""
        return kill_pids(self.pids(host))

    # -- faults --------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        sh("ip", "link", "set", self.veth(host), "down")

    def heal(self, host: str) -> None:
        sh("ip", "link", "set", self.veth(host), "up")

    def rate(self, host: str, rate: str, burst: str = "32kb", latency: str = "200ms") -> None:
        """Cap the host's link at `rate` (tc syntax: 10mbit) in both directions."""
        for cmd in (["ip", "netns", "exec", self.ns(host)], []):
            dev = "eth0" if cmd else self.veth(host)
            sh(*cmd, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
               "burst", burst, "latency", latency)  # fmt: skip

    def unrate(self, host: str) -> None:
        for cmd in (["ip", "netns", "exec", self.ns(host)], []):
            dev = "eth0" if cmd else self.veth(host)
            sh(*cmd, "tc", "qdisc", "del", "dev", dev, "root", check=False)


def kill_pids(pids: list[int]) -> list[int]:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def leftovers(prefix: str) -> dict[str, list[str]]:
    """Namespaces and links with this prefix that exist now (empty lists: none)."""
    names = [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line]
    links = [
        line.split(":")[1].strip().split("@")[0]
        for line in sh("ip", "-o", "link", "show").stdout.splitlines()
    ]
    return {
        "netns": [n for n in names if n.startswith(f"{prefix}-")],
        "links": [ln for ln in links if ln.startswith(f"{prefix}-")],
    }


def clean_stale(prefix: str) -> None:
    """Remove every namespace and link named `<prefix>-*`, after killing what runs inside."""
    found = leftovers(prefix)
    for ns in found["netns"]:
        pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
        kill_pids(pids)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        sh("ip", "netns", "del", ns, check=False)
    for link in found["links"]:
        sh("ip", "link", "del", link, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.multihost.hosts")
    p.add_argument("--prefix", default=DEFAULT_PREFIX)
    p.add_argument("--subnet", default=DEFAULT_SUBNET)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up").add_argument("n", type=int)
    run = sub.add_parser("run")
    run.add_argument("--clock-offset-s", type=float)
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    for name in ("cut", "heal", "unrate", "kill"):
        sub.add_parser(name).add_argument("host")
    rate = sub.add_parser("rate")
    rate.add_argument("host")
    rate.add_argument("rate")
    sub.add_parser("down")
    sub.add_parser("list")
    a = p.parse_args(argv)
    if a.cmd == "up":
        hosts = Hosts(a.n, a.prefix, a.subnet).up()
        for h in hosts.names:
            print(f"{h} {hosts.ns(h)} {hosts.addr(h)}")
        return 0
    if a.cmd == "down":
        clean_stale(a.prefix)
        return 0
    if a.cmd == "list":
        print(leftovers(a.prefix))
        return 0
    hosts = Hosts(len(leftovers(a.prefix)["netns"]) or 1, a.prefix, a.subnet)
    if a.cmd == "run":  # in the foreground, output to the terminal: its exit code is ours
        return subprocess.run(hosts.wrap(a.host, a.argv, a.clock_offset_s)).returncode
    if a.cmd == "kill":
        print(hosts.kill_all(a.host))
        return 0
    getattr(hosts, a.cmd)(a.host, *([a.rate] if a.cmd == "rate" else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())

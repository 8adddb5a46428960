"""The host harness itself: addresses, a cut and a heal, a capped rate, a wall-clock offset
that leaves the monotonic clock alone, and a teardown that leaves nothing behind."""

from __future__ import annotations

import sys
import time

import pytest

from tests.multihost.hosts import Hosts, leftovers

PREFIX, SUBNET = "pdhx", "10.79.0.0/24"  # not the drills' hosts, which may be up meanwhile

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 9000)); s.listen()
while True:
    c, _ = s.accept()
    while c.recv(1 << 16):
        pass
    c.sendall(b"done"); c.close()
"""

CLIENT = """
import socket, sys, time
t0 = time.monotonic()
c = socket.create_connection((sys.argv[1], 9000), timeout=3)
c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR)
assert c.recv(4) == b"done"
print(time.monotonic() - t0)
"""


@pytest.fixture(scope="module")
def hosts():
    with Hosts(3, PREFIX, SUBNET) as h:
        yield h
    assert leftovers(PREFIX) == {"netns": [], "links": []}


def send(hosts: Hosts, src: str, dst: str, nbytes: int) -> float:
    """Seconds to send `nbytes` from `src` to the server on `dst` (raises when unreachable)."""
    out = hosts.check(src, [sys.executable, "-c", CLIENT, hosts.addr(dst), str(nbytes)])
    return float(out)


def test_hosts_reach_each_other_and_a_cut_link_is_healed(hosts):
    assert [hosts.addr(h) for h in hosts.names] == ["10.79.0.11", "10.79.0.12", "10.79.0.13"]
    server = hosts.run("h3", [sys.executable, "-c", SERVER, hosts.addr("h3")])
    deadline = time.monotonic() + 10
    while True:
        try:
            send(hosts, "h2", "h3", 10)
            break
        except Exception:
            assert time.monotonic() < deadline, "h2 cannot reach h3"
            time.sleep(0.1)
    hosts.cut("h3")
    with pytest.raises(Exception):  # noqa: B017  (a timeout inside the client: exit code 1)
        send(hosts, "h2", "h3", 10)
    hosts.heal("h3")
    time.sleep(0.3)
    assert send(hosts, "h2", "h3", 10) < 2
    # A capped link: 512 KiB at 8 Mbit/s takes about half a second; uncapped, far less.
    fast = send(hosts, "h2", "h3", 512 * 1024)
    hosts.rate("h3", "8mbit")
    slow = send(hosts, "h2", "h3", 512 * 1024)
    hosts.unrate("h3")
    assert slow > 0.4 and fast < slow / 4, (fast, slow)
    # Every process a host runs is inside its namespace, and ended by pid.
    assert server.pid in hosts.pids("h3")
    assert hosts.kill_all("h3") and server.wait(5) is not None


def test_clock_offset_moves_the_wall_clock_and_sleep_still_works(hosts):
    code = "import time; w = time.time(); time.sleep(0.2); print(w, time.time() - w)"
    out = hosts.check("h1", [sys.executable, "-c", code], clock_offset_s=-10)
    wall, slept = map(float, out.split())
    now_wall = time.time()
    assert -11.5 < wall - now_wall < -9, wall - now_wall
    assert 0.15 < slept < 1.5, slept  # time passes at its normal rate there

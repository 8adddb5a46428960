"""What stops a NIXL WRITE in flight, between two hosts over a slow link (issue 27).

The protocol's safety rests on it: once a connection's lease lapses, the prefill node
stops its WRITEs still in flight, and the decode node reuses the blocks `abort_grace_s`
after the lease (kv_transfer/prefill_send.py). Measured here over real NIXL (UCX over TCP
on a veth link capped at 8 Mbit/s both ways: a 32 MiB WRITE would take a minute), with
the project's own `NixlTransport` on both hosts (tests/multihost/cancel_probe.py):

- releasing the PENDING handle (NIXL's "cancel") does not stop the data: it goes on
  landing at the link's rate as long as the sender's engine loop progresses its agent;
- `stop_writes()` does: at most what the kernel's socket buffers held lands after it, and
  nothing more by `abort_grace_s` (2 s); the rebuilt agent then carries a new WRITE to the
  same peer intact.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.multihost.hosts import Hosts, leftovers

pytest.importorskip("nixl")

PREFIX, SUBNET = "pdcx", "10.82.0.0/24"
ABORT_GRACE_S = 2.0  # the connector's default
AFTER_S = 4.0  # how long the sender's loop goes on progressing after the release/stop
MIB = 2**20


def run_probe(tmp: Path, stop: bool) -> tuple[list[dict], list[dict]]:
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    probe = [sys.executable, "-m", "tests.multihost.cancel_probe"]
    repo = Path(__file__).resolve().parents[2]
    with Hosts(2, PREFIX, SUBNET) as hosts:
        hosts.rate("h1", "8mbit")
        target = hosts.run(
            "h2", [*probe, "target", "--dir", str(tmp), "--for-s", "22"],
            env=env, log=tmp / "target.log", cwd=repo,
        )  # fmt: skip
        initiator = hosts.run(
            "h1", [*probe, "initiator", "--dir", str(tmp), "--release-after", "1",
                   "--after-s", str(AFTER_S), *(["--stop"] if stop else [])],
            env=env, log=tmp / "initiator.log", cwd=repo,
        )  # fmt: skip
        assert initiator.wait(90) == 0, (tmp / "initiator.log").read_text()[-3000:]
        assert target.wait(90) == 0, (tmp / "target.log").read_text()[-3000:]
    assert leftovers(PREFIX) == {"netns": [], "links": []}

    def lines(name: str) -> list[dict]:
        return [json.loads(x) for x in (tmp / name).read_text().splitlines() if x.startswith("{")]

    return lines("initiator.log"), lines("target.log")


def landed_at(samples: list[dict], t: float) -> int:
    """Bytes landed in the last sample taken at or before monotonic time `t` (one clock:
    both namespaces are on this machine)."""
    return max((s["landed"] for s in samples if s["t"] <= t), default=0)


def test_a_released_write_goes_on_landing(tmp_path):
    """The reason for `stop_writes`: if this fails, NIXL now cancels on release."""
    events, samples = run_probe(tmp_path, stop=False)
    released = next(e for e in events if "released" in e)
    assert released["released"] == "PENDING"  # the link is far too slow for 32 MiB in 1 s
    at = landed_at(samples, released["t"])
    later = landed_at(samples, released["t"] + AFTER_S - 0.2)
    print(f"released: {at / MIB:.2f} MiB landed, {later / MIB:.2f} MiB {AFTER_S - 0.2:.1f} s on")
    assert later - at > 1 * MIB  # ~0.45 MB/s went on landing


def test_stop_writes_ends_a_write_in_flight_and_the_agent_carries_the_next(tmp_path):
    events, samples = run_probe(tmp_path, stop=True)
    stopped = next(e for e in events if "stopped" in e)
    assert stopped["stopped"] == 1 and stopped["state"] == "FAILED"
    second = next(e for e in events if "second_posted" in e)
    at = landed_at(samples, stopped["t"])
    by_grace = landed_at(samples, stopped["t"] + ABORT_GRACE_S)
    before_second = landed_at(samples, second["t"] - 0.05)
    print(f"stopped: {at / MIB:.2f} MiB landed, +{(by_grace - at) / 2**10:.0f} KiB by the grace")
    assert by_grace - at < 1 * MIB  # what the socket buffers held, no more
    assert before_second == by_grace  # nothing landed between the grace and the next WRITE
    assert before_second < 8 * MIB  # far from the 32 MiB the WRITE would have landed
    assert [e["second"] for e in events if "second" in e] == ["DONE"]
    final = next(s for s in samples if s.get("final"))
    assert final["tail_twos"]  # the rebuilt agent's WRITE landed intact

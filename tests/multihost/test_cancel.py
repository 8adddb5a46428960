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
import time
from pathlib import Path

import pytest

from tests.multihost.hosts import Hosts, leftovers

pytest.importorskip("nixl")

PREFIX, SUBNET = "pdcx", "10.82.0.0/24"
ABORT_GRACE_S = 2.0  # the connector's default
AFTER_S = 4.0  # how long the sender's loop goes on progressing after the release/stop
MIB = 2**20


def run_probe(
    tmp: Path, stop: bool, cut_s: float = 0.0, fence: bool = False
) -> tuple[list[dict], list[dict], dict[str, float]]:
    """`cut_s` > 0: the initiator's link is cut 1 s after its WRITE is posted (before its
    `stop_writes`, at 2 s) and healed `cut_s` later; with `fence` the target fences its
    incoming connections halfway through the cut. Returns both sides' JSON lines and the
    cut's times."""
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    probe = [sys.executable, "-m", "tests.multihost.cancel_probe"]
    repo = Path(__file__).resolve().parents[2]
    release_after, after_s = (2.0, cut_s + 8.0) if cut_s else (1.0, AFTER_S)
    marks: dict[str, float] = {}
    with Hosts(2, PREFIX, SUBNET) as hosts:
        hosts.rate("h1", "8mbit")
        target = hosts.run(
            "h2", [*probe, "target", "--dir", str(tmp), "--for-s", str(22 + 2 * cut_s),
                   *(["--fence"] if fence else [])],
            env=env, log=tmp / "target.log", cwd=repo,
        )  # fmt: skip
        initiator = hosts.run(
            "h1", [*probe, "initiator", "--dir", str(tmp), "--release-after", str(release_after),
                   "--after-s", str(after_s), *(["--stop"] if stop else [])],
            env=env, log=tmp / "initiator.log", cwd=repo,
        )  # fmt: skip
        if cut_s:
            log, deadline = tmp / "initiator.log", time.monotonic() + 60
            while not (log.exists() and '"posted"' in log.read_text()):
                assert time.monotonic() < deadline and initiator.poll() is None, log.read_text()
                time.sleep(0.01)
            time.sleep(1.0)
            marks["cut"] = time.monotonic()
            hosts.cut("h1")
            time.sleep(cut_s / 2)
            if fence:
                (tmp / "fence").touch()
            time.sleep(cut_s / 2)
            marks["heal"] = time.monotonic()
            hosts.heal("h1")
        assert initiator.wait(90 + cut_s) == 0, (tmp / "initiator.log").read_text()[-3000:]
        assert target.wait(90) == 0, (tmp / "target.log").read_text()[-3000:]
    assert leftovers(PREFIX) == {"netns": [], "links": []}

    def lines(name: str) -> list[dict]:
        return [json.loads(x) for x in (tmp / name).read_text().splitlines() if x.startswith("{")]

    return lines("initiator.log"), lines("target.log"), marks


def landed_at(samples: list[dict], t: float) -> int:
    """Bytes landed in the last sample taken at or before monotonic time `t` (one clock:
    both namespaces are on this machine)."""
    return max((s["landed"] for s in samples if s["t"] <= t), default=0)


def test_a_released_write_goes_on_landing(tmp_path):
    """The reason for `stop_writes`: if this fails, NIXL now cancels on release."""
    events, samples, _ = run_probe(tmp_path, stop=False)
    released = next(e for e in events if "released" in e)
    assert released["released"] == "PENDING"  # the link is far too slow for 32 MiB in 1 s
    at = landed_at(samples, released["t"])
    later = landed_at(samples, released["t"] + AFTER_S - 0.2)
    print(f"released: {at / MIB:.2f} MiB landed, {later / MIB:.2f} MiB {AFTER_S - 0.2:.1f} s on")
    assert later - at > 1 * MIB  # ~0.45 MB/s went on landing


def test_stop_writes_ends_a_write_in_flight_and_the_agent_carries_the_next(tmp_path):
    events, samples, _ = run_probe(tmp_path, stop=True)
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


CUT_S = 6.0  # longer than the grace: the decode node reuses the blocks during the cut


def test_a_stopped_write_lands_after_a_partition_heals(tmp_path):
    """The reason for `fence_incoming`: the grace is no bound once the link is down. The
    initiator stops its WRITE while its link is cut; what its kernel still held for the
    dead socket is retransmitted when the link heals, seconds after stop + grace, and the
    target's UCX writes it. If this fails, the kernel or UCX now drops it."""
    events, samples, marks = run_probe(tmp_path, stop=True, cut_s=CUT_S)
    stopped = next(e for e in events if "stopped" in e)
    assert marks["cut"] < stopped["t"] < marks["heal"]
    by_grace = landed_at(samples, stopped["t"] + ABORT_GRACE_S)
    at_heal = landed_at(samples, marks["heal"])
    later = landed_at(samples, next(e for e in events if "second_posted" in e)["t"] - 0.05)
    print(f"stopped in the cut: +{(later - at_heal) / 2**10:.0f} KiB landed after the heal")
    assert at_heal == by_grace  # nothing moved during the cut
    assert later > at_heal  # after the heal, long after stop + grace


def test_a_fenced_target_takes_nothing_after_the_heal(tmp_path):
    """`fence_incoming` during the cut (as the decode node does when it fences a peer,
    before it reuses the blocks): nothing lands after it, the heal included; the
    initiator's next WRITE, on the target's new metadata, lands intact."""
    events, samples, marks = run_probe(tmp_path, stop=True, cut_s=CUT_S, fence=True)
    fenced = next(s for s in samples if "fenced" in s)
    assert marks["cut"] < fenced["t"] < marks["heal"] and fenced["fenced"] == 1
    second = next(e for e in events if "second_posted" in e)
    before_second = landed_at(samples, second["t"] - 0.05)
    print(
        f"fenced: {fenced['landed'] / MIB:.2f} MiB landed before, {before_second / MIB:.2f} after"
    )
    assert before_second == fenced["landed"]
    assert [e["second"] for e in events if "second" in e] == ["DONE"]
    final = next(s for s in samples if s.get("final"))
    assert final["tail_twos"]

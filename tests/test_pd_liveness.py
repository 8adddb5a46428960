"""Liveness of PD peers over the real protocol (issue 29, items 4 and 5): real NIXL, real
ZMQ with CurveZMQ and sealed frames (a cluster secret), real control pump threads, three
real engines (two prefill nodes, one decode node) driven from this process, so the test
decides when an engine loop runs: a prefill engine "hangs" when its loop is not stepped
while its pump thread keeps answering heartbeats, exactly what a stuck engine thread
does in a node.

* A decode node that reconnects 1,000 times (each a new DEALER, a new ZMQ identity, a
  Curve handshake and a `PeerHello`) still gets its orders served, and the prefill
  node's peer tables stay at one entry (they used to keep every identity, refusing
  every peer after 256).
* A prefill engine that hangs while holding an order is declared stuck within
  `engine_stall_s` (heartbeat answers carry its step counter): the order fails over to
  the other prefill node, new orders avoid it, the hung attempt's blocks stay held until
  its connection is fenced and the last lease on it ran out (its abort is never
  answered), and once the engine steps again it takes orders again. Outputs equal the
  transformers reference throughout.
* A prefill node with the secret whose done names a first token outside the vocabulary
  (2**40, -1): the attempt fails over, counted and logged with the peer's address.
"""

import os
import time

import pytest

from pdserve.decode.role import DecodeRole
from pdserve.engine.core import EngineCore
from pdserve.kv_transfer.control_channel import LEASE_STRETCH
from pdserve.kv_transfer.nixl_connector import nixl_connector
from pdserve.prefill.role import PrefillRole
from tests.hf_reference import hf_greedy, load_hf
from tests.test_pd_engine import GREEDY, make_config, prompts_of

pytest.importorskip("nixl")

STALL_S = 1.0  # engine_stall_s: short, but a real wait
GRACE_S = 0.5
PEER_TIMEOUT_S = 3.0  # also each lease's length


class Trio:
    def __init__(self, model_dir):
        secret = os.urandom(24)
        self.pconns = [
            nixl_connector(
                node_id=f"p{i}",
                role="prefill",
                control_address="tcp://127.0.0.1:*",
                cluster_secret=secret,
                abort_grace_s=GRACE_S,
            )
            for i in range(2)
        ]
        self.prefills = [EngineCore(make_config(model_dir), PrefillRole(c)) for c in self.pconns]
        self.addrs = [c.control_address for c in self.pconns]
        self.dconn = nixl_connector(
            node_id="d",
            role="decode",
            cluster_secret=secret,
            abort_grace_s=GRACE_S,
            peer_timeout_s=PEER_TIMEOUT_S,
            engine_stall_s=STALL_S,
        )
        self.drole = DecodeRole(
            self.dconn, transfer_timeout_s=60.0, prefill_nodes=tuple(self.addrs)
        )
        self.decode = EngineCore(make_config(model_dir), self.drole)
        self.hung: set[int] = set()
        self.outs: dict[str, list[int]] = {}

    def step(self) -> None:
        for o in self.decode.step():
            self.outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        for i, p in enumerate(self.prefills):
            if i not in self.hung:
                assert p.step() == []

    def until(self, cond, max_s: float = 60.0) -> float:
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < max_s, "condition not reached"
            self.step()
        return time.monotonic() - t0

    def idle(self) -> bool:
        live = [p for i, p in enumerate(self.prefills) if i not in self.hung]
        return not self.decode.has_unfinished and not any(p.has_unfinished for p in live)

    def check_baseline(self) -> None:
        for core in [self.decode, *self.prefills]:
            core.check_integrity()
            assert core.kv.pool.num_used_blocks == 0 and not core.kv.holds

    def close(self) -> None:
        self.drole.shutdown()
        for p in self.prefills:
            p.kv_role.shutdown()


@pytest.fixture(scope="module")
def trio(tiny_llama_dir):
    t = Trio(tiny_llama_dir)
    yield t
    t.close()


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


def test_a_decode_node_reconnecting_1000_times_is_still_served(trio, hf_model):
    p0, side = trio.prefills[0], trio.pconns[0]
    prompt = prompts_of([30], seed=11)[0]
    trio.decode.add_request("warm", prompt, GREEDY, remote_prefill=trio.addrs[0])
    trio.until(trio.idle)
    control = trio.dconn.control
    for i in range(1000):  # each: the DEALER closed, a new one (new identity) says hello
        control.fence(trio.addrs[0])
        if i % 50 == 49:
            trio.step()
    trio.step()
    prompt2 = prompts_of([41], seed=12)[0]
    orders = p0.kv_role.num_orders
    trio.decode.add_request("after", prompt2, GREEDY, remote_prefill=trio.addrs[0])
    trio.until(trio.idle)
    assert p0.kv_role.num_orders == orders + 1  # served by this prefill node, not locally
    assert trio.outs["after"] == hf_greedy(hf_model, prompt2, 8)
    assert trio.outs["warm"] == hf_greedy(hf_model, prompt, 8)
    # the tables hold the live connection only, not 1,001 identities
    assert len(side.peers.agents) == 1 and not side.peers.refused
    assert len(side.control.last_heard) <= 2 and len(side.control._leases) <= 2
    assert len(side.data.peers) == 1
    assert control.num_peers == 1
    trio.check_baseline()


def test_a_stuck_prefill_engine_is_failed_over_and_taken_back(trio, hf_model):
    p0, a0 = trio.prefills[0], trio.addrs[0]
    d = trio.dconn.control
    prompt = prompts_of([60], seed=13)[0]
    trio.decode.add_request("stuck", prompt, GREEDY, remote_prefill=a0)
    trio.until(lambda: any(r.startswith("stuck@") for r in p0.requests))
    trio.hung.add(0)  # p0's engine loop stops here, holding the order; its pump runs on
    key = ("stuck", trio.decode.requests["stuck"].attempt)
    t_hang = time.monotonic()
    failovers = trio.drole.num_failovers
    waited = trio.until(lambda: trio.drole.num_failovers > failovers, max_s=30)
    # the figure: a stuck prefill engine to the first order routed elsewhere
    print(f"\nstuck prefill engine -> order routed elsewhere: {waited:.2f} s")
    assert STALL_S < waited < STALL_S + 3.0  # not the 60 s transfer timeout
    assert d.stuck(a0) and not d.dead(a0)  # it answers heartbeats: stuck, not dead
    assert not trio.dconn.peer_alive(a0)
    assert key in trio.decode.kv.holds  # p0 may still write: held until provably not
    # a new order meant for the stuck node goes to the other one at once
    other = prompts_of([33], seed=14)[0]
    before = trio.prefills[1].kv_role.num_orders
    trio.decode.add_request("new", other, GREEDY, remote_prefill=a0)
    trio.until(lambda: "new" in trio.outs and len(trio.outs["new"]) == 8)
    assert trio.prefills[1].kv_role.num_orders >= before + 1
    trio.until(lambda: "stuck" in trio.outs and len(trio.outs["stuck"]) == 8)
    assert trio.outs["stuck"] == hf_greedy(hf_model, prompt, 8)
    assert trio.outs["new"] == hf_greedy(hf_model, other, 8)
    # its abort is never answered: fenced, then released once the last lease ran out
    released = trio.until(lambda: key not in trio.decode.kv.holds, max_s=30)
    held_for = time.monotonic() - t_hang
    assert held_for > STALL_S + GRACE_S + PEER_TIMEOUT_S * 0.5, held_for
    assert held_for < STALL_S + GRACE_S + PEER_TIMEOUT_S * LEASE_STRETCH + GRACE_S + 5, released
    # the engine steps again: alive again, and it takes orders again
    trio.hung.clear()
    trio.until(lambda: trio.dconn.peer_alive(a0), max_s=10)
    orders = p0.kv_role.num_orders
    back = prompts_of([25], seed=15)[0]
    trio.decode.add_request("back", back, GREEDY, remote_prefill=a0)
    trio.until(trio.idle)
    assert p0.kv_role.num_orders == orders + 1
    assert trio.outs["back"] == hf_greedy(hf_model, back, 8)
    trio.check_baseline()


@pytest.mark.parametrize("first_token", [2**40, -1])
def test_a_done_with_its_first_token_out_of_range_fails_over(trio, hf_model, first_token, caplog):
    """Issue 29 item 2 through a decode engine and its role: prefill node 0 holds the
    secret and speaks the real protocol (its real KV, every block, a sealed done), but
    its done names a first token outside the vocabulary. The decode node fails that
    attempt over, counts it (`pd_bad_dones`), logs the peer, and the request's tokens
    still equal the reference; its engine keeps stepping."""
    p0, a0, side = trio.prefills[0], trio.addrs[0], trio.pconns[0]
    honest = side.finish

    def lying(key, src, first_index, first, *args, **kw):
        honest(key, src, first_index, first_token, *args, **kw)

    side.finish = lying
    bad, failovers = trio.dconn.num_bad_dones, trio.drole.num_failovers
    prompt = prompts_of([37], seed=16 + (first_token < 0))[0]
    rid = f"lie{first_token}"
    orders = p0.kv_role.num_orders
    try:
        trio.decode.add_request(rid, prompt, GREEDY, remote_prefill=a0)
        trio.until(trio.idle)
    finally:
        side.finish = honest
    assert p0.kv_role.num_orders == orders + 1  # the lying node was asked, and answered
    assert trio.outs[rid] == hf_greedy(hf_model, prompt, 8)
    assert trio.dconn.num_bad_dones == bad + 1 and trio.drole.num_failovers > failovers
    assert trio.decode.stats().pd_bad_dones == bad + 1
    assert f"bad done from prefill node {a0}" in caplog.text
    assert f"first token {first_token} outside the vocabulary" in caplog.text
    trio.check_baseline()

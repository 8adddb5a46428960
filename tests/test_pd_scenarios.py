"""The eight failure scenarios of issue 8, one named test each, asserting the state in
between (blocks still held right after the abort, attempts failed over before their
deadline, ...). Most run on the simulated cluster of tests/pd_sim (real roles, schedulers,
KV managers and connector sides; in-memory transport); the control-channel ones run the
real `DecodeControl` over real ZMQ sockets. Scenario 3 (NaN temperature) is in
test_request_validation.py and test_server.py; scenario 7 (CUDA event) is issue 16's.
"""

import contextlib
import math
import time

import msgspec
import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.control_channel import DecodeControl
from pdserve.kv_transfer.decode_side import DecodeSide, RecvState
from pdserve.kv_transfer.prefill_side import SendState
from pdserve.kv_transfer.transfer_types import PeerMetadata
from tests.pd_sim.cluster import Cluster, Timing
from tests.pd_sim.stub_model import expected_output
from tests.pd_sim.world import Faults, SimData, SimDealerLink, World

PROMPT = list(range(10, 50))  # 40 tokens = 10 blocks of 4


def step_until(c: Cluster, cond, max_s: float = 10.0) -> None:
    end = c.world.now + max_s
    while not cond():
        assert c.world.now < end, c.describe()
        c.step()


def pending_writes(c: Cluster, key) -> list:
    return [w for w in c.world.writes if w.key == key]


def test_1_abort_on_decode_holds_blocks_until_no_write_can_land():
    c = Cluster(faults=Faults(write_delay=0.5), num_prefill=1, prefill_budget=8)
    c.submit("a", PROMPT, 3)
    key = ("a", 1)
    step_until(c, lambda: pending_writes(c, key))
    blocks = set(c.decode.kv.get_block_ids("a"))
    c.abort("a")
    # right after the abort: the blocks are held, owned by the role, not free
    assert set(c.decode.kv.hold_block_ids(key)) == blocks
    assert key in c.drole.claimed_holds()
    assert c.dside.states()[key] is RecvState.CANCELLED
    used_while_held = c.decode.kv.pool.num_used_blocks
    c.submit("b", list(range(100, 130)), 2)  # a new request must get other blocks
    c.step()
    assert not blocks & set(c.decode.kv.get_block_ids("b"))
    assert c.decode.kv.pool.num_used_blocks > used_while_held
    # released only once the prefill node acknowledged with nothing in flight
    step_until(c, lambda: key not in c.decode.kv.holds)
    assert not pending_writes(c, key)
    c.run_until_idle()
    c.check_final()
    assert c.reqs["a"].finish == "abort" and c.reqs["b"].finish == "length"


def test_2_unreachable_or_invalid_prefill_address_fails_that_request_only():
    world = World(0)
    side = DecodeSide(
        lambda hello: DecodeControl(hello, heartbeat_s=0.05, peer_timeout_s=0.3, max_peers=3),
        lambda kv: SimData(world, "d", kv),
    )
    side.register_kv_cache(torch.zeros(1, 2, 16, 4, 1, 1))
    try:
        order = _order("x", 1, dst=[0, 1])
        side.request_prefill(order, "tcp://no:such:address")  # connect() raises
        assert [type(e).__name__ for e in side.poll()] == ["RecvFailed", "Released"]
        for i in range(6):  # distinct addresses: at most max_peers connections at once
            side.request_prefill(_order(f"r{i}", 1, dst=[2 + i]), f"tcp://127.0.0.1:{1 + i}")
        assert side.control.num_peers == 3
        deadline = time.monotonic() + 30
        events = []
        while len([e for e in events if type(e).__name__ == "Released"]) < 6:
            assert time.monotonic() < deadline, events
            events += side.poll()
            time.sleep(0.01)
        # nobody listens: 3 refused at once, 3 declared dead and withdrawn (never sent)
        assert sum(type(e).__name__ == "RecvFailed" for e in events) == 6
        assert not side.has_pending()
    finally:
        side.close()


def test_3_nan_temperature_is_refused_at_the_boundary():
    """Clients: a 400 (test_server.py hostile values; the engine survives a row that still
    fails: test_request_validation.py). Peers: an order carrying NaN is rejected by key."""
    with pytest.raises(ValueError):
        SamplingParams(temperature=math.nan)
    c = Cluster(num_prefill=1)
    link = _hostile_link(c)
    raw = msgspec.to_builtins(_order("n", 1, dst=list(range(10)), prompt=PROMPT,
                                     agent="evil"))  # fmt: skip
    raw["params"]["temperature"] = math.nan
    link.send(msgspec.msgpack.encode(raw))
    (r,) = _replies(c, link, 1)
    assert isinstance(r, m.PrefillRejected) and (r.request_id, r.attempt) == ("n", 1)
    assert "temperature" in r.reason
    c.submit("ok", PROMPT, 2)
    c.run_until_idle()
    c.check_final()
    assert c.reqs["ok"].tokens == expected_output(PROMPT, 2)


def test_4_dead_prefill_node_fails_over_at_once_and_blocks_free_when_provable():
    t = Timing(transfer_timeout_s=5.0, peer_timeout_s=0.3)
    c = Cluster(faults=Faults(write_delay=0.3), timing=t, num_prefill=2, prefill_budget=4)
    p0, p1 = c.addrs
    c.submit("a", PROMPT, 2, node=p0)
    step_until(c, lambda: c.prefills[p0].requests)  # p0 is computing
    c.kill(p0)
    t_kill = c.world.now
    step_until(c, lambda: c.dside.states().get(("a", 1)) is not RecvState.ORDERED)
    waited = c.world.now - t_kill
    assert waited < t.peer_timeout_s + 0.5 < t.transfer_timeout_s  # not the full deadline
    # held, its connection fenced: p0 may still write until its last lease runs out
    assert c.dside.states()[("a", 1)] is RecvState.FENCED
    assert ("a", 1) in c.decode.kv.holds
    c.step()
    assert c.dside._attempts[("a", 2)].node == p1  # failed over to the live node
    c.run_until_idle()
    c.check_final()
    assert c.reqs["a"].tokens == expected_output(PROMPT, 2)


def test_4_engine_thread_never_blocks_on_a_dead_peer():
    """2000 orders to a prefill address where nothing listens: every call returns at
    once, the bounded queue refuses the excess, and when the peer is declared dead every
    queued order is withdrawn (never sent) so its blocks are released at once."""
    world = World(0)
    side = DecodeSide(
        lambda hello: DecodeControl(hello, heartbeat_s=0.05, peer_timeout_s=0.3, max_queued=500),
        lambda kv: SimData(world, "d", kv),
    )
    side.register_kv_cache(torch.zeros(1, 2, 4096, 4, 1, 1))
    try:
        dead = "tcp://127.0.0.1:9"  # discard port: nothing listens
        for i in range(2000):
            side.request_prefill(_order(f"r{i}", 1, dst=[i]), dead)
        events = side.poll()
        refused = [e for e in events if type(e).__name__ == "RecvFailed"]
        assert len(refused) == 2000 - 499  # the hello takes one queue slot
        deadline = time.monotonic() + 30
        while side.has_pending():
            assert time.monotonic() < deadline
            events += side.poll()
            time.sleep(0.01)
        assert sum(type(e).__name__ == "Released" for e in events) == 2000
    finally:
        side.close()


def _hostile_link(
    c: Cluster, block_size: int = 4, num_blocks: int = 64, name: str = "evil"
) -> SimDealerLink:
    kv = torch.zeros(1, 2, num_blocks, block_size, 1, 1)
    SimData(c.world, name, kv)
    link = SimDealerLink(c.world, c.addrs[0], name.encode())
    md = msgspec.msgpack.encode(PeerMetadata(name, b"", c.world.planes[name].layout))
    link.send(m.encode(m.PeerHello(agent_metadata=md)))
    return link


def _replies(c: Cluster, link: SimDealerLink, n: int) -> list:
    out = []
    step_until(c, lambda: out.extend(iter(lambda: link.recv(), None)) or len(out) >= n)
    return [m.decode_to_decode(r) for r in out]


@pytest.mark.parametrize(
    ("what", "dst", "block_size"),
    [
        ("layout mismatch", list(range(10)), 8),
        ("out-of-range dst", [0, 1, 2, 3, 4, 5, 6, 7, 8, 10**6], 4),
        ("negative dst", [-1, 1, 2, 3, 4, 5, 6, 7, 8, 9], 4),
        ("duplicate dst", [0, 1, 2, 3, 4, 5, 6, 7, 8, 8], 4),
        ("too few dst", [0, 1], 4),
    ],
)
def test_5_hostile_peer_is_rejected_and_prefill_keeps_serving(what, dst, block_size):
    c = Cluster(num_prefill=1)
    link = _hostile_link(c, block_size=block_size)
    order = _order("h", 1, dst=dst, prompt=PROMPT, agent="evil")
    link.send(m.encode(order))
    link.send(b"\x93garbage")  # undecodable: dropped
    bad = msgspec.msgpack.encode({"type": "PrefillOrder", "request_id": "z", "attempt": 3})
    link.send(bad)  # malformed but readable: rejected by key
    (r1, r2) = _replies(c, link, 2)
    assert isinstance(r1, m.PrefillRejected) and isinstance(r2, m.PrefillRejected)
    assert {(r1.request_id, r1.attempt), (r2.request_id, r2.attempt)} == {("h", 1), ("z", 3)}
    core = c.prefills[c.addrs[0]]
    assert not core.requests and core.kv.pool.num_used_blocks == 0
    c.submit("ok", PROMPT, 3)  # the shared prefill node still serves a good decode node
    c.run_until_idle()
    c.check_final()
    assert c.reqs["ok"].tokens == expected_output(PROMPT, 3)


def test_5_prefill_node_takes_a_bounded_number_of_decode_peers(monkeypatch):
    import pdserve.kv_transfer.decode_peers as ps

    monkeypatch.setattr(ps, "MAX_DECODE_PEERS", 2)
    c = Cluster(faults=Faults(ctl_delay=0.0), num_prefill=1)  # each hello before its order
    c.submit("ok", PROMPT, 2)  # the honest decode node is peer 1
    c.run_until_idle()
    links = [_hostile_link(c, name=f"evil{i}") for i in range(2)]
    for i, link in enumerate(links):
        link.send(m.encode(_order("h", i, dst=list(range(10)), prompt=PROMPT,
                                  agent=f"evil{i}")))  # fmt: skip
    got: list = []
    step_until(c, lambda: got.extend(x for ln in links for x in iter(ln.recv, None)) or got)
    (refused,) = [m.decode_to_decode(x) for x in got]  # whichever hello came second
    assert isinstance(refused, m.PrefillRejected) and "takes 2 peers" in refused.reason
    c.run_until_idle()
    assert c.prefills[c.addrs[0]].kv_role.num_orders == 2  # "ok" and the admitted peer's


def test_5_forged_done_from_another_agent_is_ignored():
    """A PrefillDone must echo the order's nonce: another agent cannot declare KV complete."""
    c = Cluster(faults=Faults(write_delay=0.3), num_prefill=1)
    evil = SimData(c.world, "evil", torch.zeros(1, 2, 8, 4, 1, 1))
    c.submit("a", PROMPT, 2)
    step_until(c, lambda: pending_writes(c, ("a", 1)))
    forged = m.PrefillDone(request_id="a", attempt=1, first_token=7, logprob=None, num_blocks=10)
    evil.send_notif("d", m.encode(forged))
    step_until(c, lambda: c.world.now > c.reqs["a"].arrival + 0.2)
    assert c.dside.states()[("a", 1)] is RecvState.ORDERED  # still waiting for the real one
    c.run_until_idle()
    c.check_final()
    assert c.reqs["a"].tokens == expected_output(PROMPT, 2)


def test_6_failed_write_reaches_decode_at_once():
    c = Cluster(faults=Faults(write_fail=1.0, write_delay=0.05), num_prefill=1)
    c.submit("a", PROMPT, 2)
    step_until(c, lambda: c.drole.num_failures == 1)  # PrefillFailed, not the deadline
    assert c.world.now - c.reqs["a"].arrival < c.t.transfer_timeout_s / 2
    assert ("a", 1) not in c.dside.states()  # nothing in flight: released at once
    c.run_until_idle()
    c.check_final()
    assert c.reqs["a"].tokens == expected_output(PROMPT, 2)  # prefilled locally


def test_6_every_prefill_state_ends_by_its_deadline_plus_grace():
    """A WRITE that never completes, then the decode node aborts: ENDING waits for it,
    but only until the order's deadline (its ttl from receipt, on the prefill node's own
    clock) plus grace."""
    c = Cluster(faults=Faults(write_delay=1000.0), num_prefill=1, prefill_budget=4)
    p = c.prefills[c.addrs[0]]
    side = p.kv_role.connector
    c.submit("a", PROMPT, 2)
    step_until(c, lambda: pending_writes(c, ("a", 1)))
    c.abort("a")
    step_until(c, lambda: side.states().get(("a", 1)) is SendState.ENDING)
    deadline, clock = side._sends[("a", 1)].deadline, c.clocks[1]
    step_until(c, lambda: ("a", 1) not in side.states())
    assert deadline < clock() <= deadline + c.t.abort_grace_s / 2 + 2 * c.t.dt
    c.run_until_idle()
    c.check_final()


def test_6_order_arriving_after_its_deadline_is_refused():
    c = Cluster(faults=Faults(ctl_delay=0.0), num_prefill=1)
    c.routers[c.addrs[0]].unreachable_until = c.world.now + 2 * c.t.transfer_timeout_s
    c.drole.transfer_timeout_s = 0.2
    c.submit("a", PROMPT, 2)
    c.run_until_idle()
    c.check_final()
    assert c.reqs["a"].tokens == expected_output(PROMPT, 2)
    assert c.prefills[c.addrs[0]].kv_role.num_orders == 0  # never computed after expiry


def test_8_retry_with_the_same_request_id_never_meets_its_earlier_attempt():
    c = Cluster(faults=Faults(write_delay=0.4), num_prefill=1, prefill_budget=8)
    c.submit("r", PROMPT, 2)
    step_until(c, lambda: pending_writes(c, ("r", 1)))
    c.abort("r")
    other = list(range(200, 236))
    c.submit("r", other, 3)  # the router retries under the same id
    c.step()
    assert ("r", 1) in c.decode.kv.holds  # the earlier attempt's blocks, still held
    assert c.decode.requests["r"].attempt == 2
    held = set(c.decode.kv.hold_block_ids(("r", 1)))
    assert not held & set(c.decode.kv.get_block_ids("r"))
    c.run_until_idle()
    c.check_final()
    assert c.reqs["r"].tokens == expected_output(other, 3)


def _order(rid, attempt, *, dst, prompt=None, agent="d") -> m.PrefillOrder:
    prompt = prompt or list(range(3, 3 + 4 * len(dst)))
    return m.PrefillOrder(
        request_id=rid,
        attempt=attempt,
        prompt_token_ids=prompt,
        params=SamplingParams(temperature=0, max_tokens=1),
        decode_agent=agent,
        first_block=0,
        dst_block_ids=dst,
        ttl_s=60.0,
    )


@pytest.mark.parametrize("epoch", ["x", -5, 2**62], ids=["not-an-int", "negative", "huge"])
def test_5_a_hostile_epoch_costs_the_prefill_node_nothing(epoch):
    """A peer's `PeerHello.epoch` that is not an int is a malformed frame (dropped); a
    negative or huge one only governs that peer's own agent. The honest decode node's
    transfers go on."""
    c = Cluster(num_prefill=1)
    link = _hostile_link(c)
    md = msgspec.msgpack.encode(PeerMetadata("evil", b"", c.world.planes["evil"].layout))
    link.send(msgspec.msgpack.encode({"type": "PeerHello", "agent_metadata": md, "epoch": epoch}))
    with pytest.raises(m.MalformedMessage) if isinstance(epoch, str) else contextlib.nullcontext():
        m.decode_to_prefill(
            msgspec.msgpack.encode({"type": "PeerHello", "agent_metadata": md, "epoch": epoch})
        )
    c.submit("ok", PROMPT, 3)
    c.run_until_idle()
    c.check_final()
    assert c.reqs["ok"].tokens == expected_output(PROMPT, 3)
    peers = c.prefills[c.addrs[0]].kv_role.connector.peers
    assert peers.epochs["d"] == 0 and c.decode.stats().prefill_paths == {"remote": 1}


@pytest.mark.parametrize("epoch", ["x", -5, 2**62], ids=["not-an-int", "negative", "huge"])
def test_5_a_hostile_unsettled_epoch_costs_the_decode_node_one_fence_at_most(epoch):
    """An end message's `unsettled_epoch` from a prefill node: not an int, the frame is
    malformed (dropped, the attempt ends by its own deadline); any int ends the attempt,
    a huge one with one data fence (at most one per attempt: it is gone after). The next
    request is prefilled remotely and decodes exactly."""
    c = Cluster(faults=Faults(ctl_delay=0.0), num_prefill=1)
    c.submit("a", PROMPT, 2)
    key = ("a", 1)
    step_until(c, lambda: key in c.dside.states())
    frame = msgspec.msgpack.encode(
        {"type": "AbortAck", "request_id": "a", "attempt": 1, "unsettled_epoch": epoch}
    )
    if isinstance(epoch, str):
        with pytest.raises(m.MalformedMessage):
            m.decode_to_decode(frame)
    else:
        msg = m.decode_to_decode(frame)
        node = c.dside._attempts[key].node
        events = c.dside._on_control(node, msg)  # as `poll` does with a received frame
        assert events  # the attempt ended (RecvFailed, Released)
        c.dside._events += events  # for the decode role's next poll
        assert c.dside._on_control(node, msg) == []  # once: the attempt is gone
        assert c.dside.num_data_fences == (1 if epoch > 0 else 0)
    c.run_until_idle(max_s=60)
    c.submit("b", list(range(100, 140)), 3)
    c.run_until_idle(max_s=60)
    c.check_final()
    assert c.reqs["b"].tokens == expected_output(list(range(100, 140)), 3)
    assert c.decode.stats().prefill_paths.get("remote", 0) >= 1

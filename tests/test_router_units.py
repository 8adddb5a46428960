"""Router pieces on their own: circuit breaker states, policies' choices, SSE framing."""

from __future__ import annotations

import time

import httpx

from cluster.registry import NodeRecord
from router.breaker import CircuitBreaker
from router.nodes import NodeState
from router.policies import Context, KVAware, LeastLoaded, RoundRobin
from router.relay import SSESplitter, decode_event


def node(url: str, role: str = "prefill", **load) -> NodeState:
    rec = NodeRecord(node_id=url, role=role, url=url, model="m", block_size=16, epoch=1,
                     kv_total=100, **load)  # fmt: skip
    return NodeState(url=url, client=httpx.AsyncClient(), breaker=CircuitBreaker(), record=rec)


def test_breaker_opens_half_opens_and_closes():
    b = CircuitBreaker(failures=2, cooldown_s=0.05)
    b.record_failure()
    assert b.state == "closed" and b.allows()
    b.record_failure()
    assert b.state == "open" and not b.allows()
    time.sleep(0.06)
    assert b.state == "half_open" and b.allows()
    b.on_dispatch()
    assert not b.allows()  # one trial at a time
    b.record_failure()  # the trial failed: open again, cooldown doubled
    assert b.state == "open" and b.cooldown_s == 0.1
    time.sleep(0.11)
    b.on_dispatch()
    b.record_success()
    assert b.state == "closed" and b.allows() and b.cooldown_s == 0.05


def test_kv_aware_prefers_the_holder_unless_it_is_far_more_loaded():
    a, b = node("http://a"), node("http://b")
    ctx = Context(prompt_blocks=20, hits={"http://a": 16}, mean_prompt_blocks=20)
    assert KVAware("prefill")([a, b], ctx) is a
    a.prefill_blocks = 30  # a has 30 blocks queued: 4 + 30 > 20 + 0
    assert KVAware("prefill")([a, b], ctx) is b
    # decode: the own prefix counts against the KV already held
    d1 = node("http://d1", "decode", kv_used=50)
    d2 = node("http://d2", "decode", kv_used=10)
    ctx = Context(prompt_blocks=20, hits={"http://d1": 20}, mean_prompt_blocks=20)
    assert KVAware("decode")([d1, d2], ctx) is d2  # 0 + 50 > 20 + 10
    d1.record.kv_used = 5
    assert KVAware("decode")([d1, d2], ctx) is d1  # 0 + 5 < 20 + 10


def test_ties_rotate_and_least_loaded_picks_the_lighter():
    nodes = [node(f"http://n{i}") for i in range(3)]
    ctx = Context(4, {}, 4)
    kv = KVAware("prefill")
    assert {kv(nodes, ctx).url for _ in range(3)} == {n.url for n in nodes}
    rr = RoundRobin()
    assert [rr(nodes, ctx).url for _ in range(4)] == [
        "http://n0", "http://n1", "http://n2", "http://n0",
    ]  # fmt: skip
    busy, idle = node("http://busy", running=9), node("http://idle")
    ll = LeastLoaded(seed=0)
    assert all(ll([busy, idle], ctx) is idle for _ in range(20))


def test_sse_splitter_reassembles_events_across_any_cut():
    stream = (
        b'data: {"choices":[{"text":"a"}]}\n\ndata: {"error":{"message":"x"}}\n\ndata: [DONE]\n\n'
    )
    for cut in range(1, len(stream)):
        s = SSESplitter()
        events = s.feed(stream[:cut]) + s.feed(stream[cut:])
        assert b"".join(events) == stream and len(events) == 3
    first, err, done = SSESplitter().feed(stream)
    assert decode_event(first).choices and decode_event(err).error is not None
    assert decode_event(done) is None

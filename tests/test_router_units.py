"""Router pieces on their own: circuit breaker states, policies' choices, SSE framing."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

import pytest

from pdserve.cluster.registry import NodeRecord
from pdserve.common.block_hash import hash_block_tokens, hash_prompt_blocks, root_hash
from pdserve.router.breaker import CircuitBreaker
from pdserve.router.config import RouterConfig, RouterConfigError
from pdserve.router.nodes import NodeState
from pdserve.router.policies import Context, KVAware, LeastLoaded, RoundRobin
from pdserve.router.relay import AttemptFailed, SSESplitter, _check_status, decode_event


def node(url: str, role: str = "prefill", **load) -> NodeState:
    rec = NodeRecord(node_id=url, role=role, url=url, model="m", block_size=16, epoch=1,
                     kv_total=100, **load)  # fmt: skip
    # policies never touch the HTTP client
    return NodeState(url=url, client=None, breaker=CircuitBreaker(), record=rec)


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


def test_only_node_faults_count_toward_the_breaker():
    """Issue 29 item 6: a 500 about one request (the node's own `engine_error` body, or
    a body that is not the node's: an unhandled exception a client's input may provoke)
    is not a node fault; a 503, a 502 or `engine_dead` are."""
    n = node("http://a")
    err = b'{"error": {"message": "x", "type": "server_error", "code": "%s"}}'

    def fault(status: int, content: bytes) -> bool:
        with pytest.raises(AttemptFailed) as e:
            _check_status(n, status, content)
        return e.value.node_fault

    assert not fault(500, err % b"engine_error")
    assert fault(500, err % b"engine_dead")
    assert not fault(500, b"Internal Server Error") and not fault(500, b"")
    assert fault(503, err % b"engine_error") and fault(502, b"")
    _check_status(n, 400, err % b"x")  # a 4xx: relayed, not a failure at all


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


def _costed(costs: list[int]) -> tuple[list[NodeState], Context]:
    """Prefill nodes whose kv_aware cost (w=1, no hits) is `costs[i]` + the prompt blocks."""
    nodes = [node(f"http://t{i}") for i in range(len(costs))]
    for n, c in zip(nodes, costs):
        n.prefill_blocks = c
    return nodes, Context(prompt_blocks=4, hits={}, mean_prompt_blocks=4)


def test_kv_temperature_samples_the_softmax_of_minus_cost():
    nodes, ctx = _costed([0, 2, 4])
    policy = KVAware("prefill", temperature=2.0, seed=1)
    want = [math.exp(-c / 2.0) for c in (0, 2, 4)]
    want = [w / sum(want) for w in want]  # 0.665, 0.245, 0.090
    costs = [policy.cost(n, ctx) for n in nodes]
    assert policy.probabilities(costs) == pytest.approx(want)
    n = 6000
    picks = Counter(policy(nodes, ctx).url for _ in range(n))
    for node_, p in zip(nodes, want):
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(picks[node_.url] - n * p) < 4 * sigma, (picks, want)
    # a huge cost gap neither overflows nor loses the cheap node
    far, ctx = _costed([0, 10_000])
    assert KVAware("prefill", temperature=0.5).probabilities([4.0, 10_004.0]) == [1.0, 0.0]
    assert all(KVAware("prefill", temperature=0.5)(far, ctx) is far[0] for _ in range(50))


def test_kv_temperature_zero_is_the_deterministic_argmin():
    nodes, ctx = _costed([3, 1, 2, 1])
    runs = []
    for _ in range(2):  # two routers pick the same sequence: cheapest, ties in url order
        policy = KVAware("prefill", temperature=0.0)
        runs.append([policy(nodes, ctx).url for _ in range(6)])
    assert runs[0] == runs[1] == ["http://t1", "http://t3"] * 3


def test_kv_temperature_config_is_checked():
    with pytest.raises(RouterConfigError, match="kv_temperature"):
        RouterConfig(decode_urls=("http://a",), kv_temperature=-1.0)
    with pytest.raises(RouterConfigError, match="kv_temperature"):
        RouterConfig(decode_urls=("http://a",), kv_temperature=float("nan"))
    assert RouterConfig(decode_urls=("http://a",), kv_temperature=0.5).kv_temperature == 0.5


def test_prompt_chain_equals_the_engine_block_by_block_chain():
    root = root_hash("m", 4)
    for n in (0, 3, 4, 9, 64):
        tokens = [(i * 7919) % 50_000 for i in range(n)]
        chain, parent = [], root
        for start in range(0, n - 3, 4):
            parent = hash_block_tokens(parent, tokens[start : start + 4])
            chain.append(parent)
        assert hash_prompt_blocks(tokens, 4, root) == chain


def test_prefix_hits_counts_leading_blocks_per_node_in_one_script(redis_server):
    from pdserve.cluster.kv_index import PrefixHits
    from pdserve.cluster.redis_client import connect
    from pdserve.common.redis_keys import ClusterKeys

    keys = ClusterKeys("t")
    chain = [bytes([i]) * 16 for i in range(1, 41)]  # a 40-block prompt
    held = {"a": 0, "b": 1, "c": 17, "d": 39, "e": 40}  # leading blocks each node holds

    async def run() -> dict[str, int]:
        redis = connect(redis_server.url)
        pipe = redis.pipeline(transaction=False)
        for node_id, n in held.items():
            pipe.sadd(keys.kv(node_id, 1), b"", *chain[:n], b"other-prompt-block")
        pipe.sadd(keys.kv("a", 0), *chain)  # a's previous boot: never counts
        await pipe.execute()
        recs = [NodeRecord(node_id=i, role="prefill", url=f"http://{i}", model="m",
                           block_size=16, epoch=1) for i in held]  # fmt: skip
        try:
            return await PrefixHits(redis, keys)(recs, lambda rec: chain)
        finally:
            await redis.aclose()

    assert asyncio.run(run()) == held


def test_open_stream_keeps_every_event_of_the_read_that_brings_the_first_token():
    """A node may flush several events at once (one read): none may be lost."""
    from aiohttp import web

    from pdserve.router.node_http import NodePool
    from pdserve.router.relay import open_stream

    events = [b'data: {"choices": [{"text": "%d"}]}\n\n' % i for i in range(4)] + [
        b"data: [DONE]\n\n"
    ]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"".join(events))  # every event in one write
        await resp.write_eof()
        return resp

    async def run() -> list[bytes]:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        pool = NodePool(url, {}, None, connect_timeout_s=5, read_timeout_s=30)
        n = NodeState(url=url, client=None, breaker=CircuitBreaker(), http=pool)
        opened = await open_stream(n, "/v1/completions", b"{}", {}, preamble_events=0)
        got = list(opened.held)
        async for data in opened.rest:
            got += opened.splitter.feed(data)
        opened.close()
        pool.close()
        await runner.cleanup()
        return got

    assert asyncio.run(run()) == events


def test_remote_prefill_share_in_cluster_view_and_status():
    """Issue 30: a node's record counts its prompts prefilled remotely and here; `/cluster`
    shows the share, `pdserve status` its percentage (a signed record round-trips it)."""
    from pdserve.cluster.status import render
    from pdserve.router.nodes import remote_prefill_share

    rec = NodeRecord(node_id="d0", role="decode", url="http://d0", model="m", block_size=16,
                     epoch=1, prefills_remote=3, prefills_local=1)  # fmt: skip
    back = NodeRecord.from_redis({k.encode(): v.encode() for k, v in rec.to_redis(b"s").items()})
    assert remote_prefill_share(back) == 0.75
    rec.prefills_remote = rec.prefills_local = 0
    assert remote_prefill_share(rec) is None and remote_prefill_share(None) is None
    line = render(None, [{"key": "pd:node:d0", **back.to_redis()}]).splitlines()[-1]
    assert line.split()[:2] == ["d0", "decode"] and " 75% " in line


def test_a_migration_is_named_by_the_path_its_node_reports():
    """router/migration.py: the `: kv <prefill path> <cached tokens>` line of the new node;
    anything else a node sends there names nothing (the expected path is used)."""
    from pdserve.router.migration import kv_path

    assert kv_path(b"remote 0") == "prefill_node"
    assert kv_path(b"store_hit 512") == "store"
    assert kv_path(b"local_policy 992") == "prefix_cache"
    assert kv_path(b"local_policy 0") == "local"
    assert kv_path(b"local_transfer_failed 0") == "local"
    for bad in (b"", b"remote", b"remote -1", b"evil 5", b"remote 1 2", b"\xff\xfe 3"):
        assert kv_path(bad) is None

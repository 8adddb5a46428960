"""The router's lean Redis client (cluster/redis_client.py `LeanRedis`) against a real
redis-server: pipelined replies reach their own callers, scripts survive a script flush,
a lost server raises ConnectionError and a restarted one is used again, a connect whose
caller was cancelled is never handed out stale (lost, or failed), a server that does
not answer raises TimeoutError within its deadline, passwords and databases apply, and
commands started early (`script.start`) keep their own replies when one is cancelled."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import redis
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from pdserve.cluster.embedded_redis import EmbeddedRedis
from pdserve.cluster.redis_client import LeanRedis, lean_client


def test_lean_client_only_for_plain_redis_urls():
    assert lean_client("redis://127.0.0.1:6380/2", 1.0).db == 2
    c = lean_client("redis://user:p%40ss@h:1", 1.0)
    assert (c.host, c.port, c.username, c.password) == ("h", 1, "user", "p@ss")
    for url in ("rediss://h:1", "unix:///tmp/r.sock", "redis://h:1?db=3", "redis://h:1/x"):
        assert lean_client(url, 1.0) is None, url


def test_concurrent_commands_each_get_their_own_reply(redis_server):
    async def run() -> list:
        r = lean_client(redis_server.url, 5.0)
        try:
            return await asyncio.gather(*(r.execute("ECHO", f"v{i}") for i in range(200)))
        finally:
            await r.aclose()

    assert asyncio.run(run()) == [f"v{i}".encode() for i in range(200)]


def test_error_reply_raises_and_the_connection_stays_in_step(redis_server):
    async def run() -> bytes:
        r = lean_client(redis_server.url, 5.0)
        try:
            with pytest.raises(ResponseError, match="unknown command"):
                await r.execute("NOSUCHCOMMAND")
            return await r.execute("ECHO", "after")
        finally:
            await r.aclose()

    assert asyncio.run(run()) == b"after"


def test_script_is_loaded_again_after_a_script_flush(redis_server):
    async def run() -> list:
        r = lean_client(redis_server.url, 5.0)
        script = r.script("return {KEYS[1], ARGV[1]}")
        try:
            first = await script(keys=["k"], args=["a"])
            await r.execute("SCRIPT", "FLUSH")  # as after a Redis restart: NOSCRIPT
            return [first, await script(keys=["k"], args=["b"])]
        finally:
            await r.aclose()

    assert asyncio.run(run()) == [[b"k", b"a"], [b"k", b"b"]]


def test_lost_server_raises_connection_error_and_a_restarted_one_is_used():
    server = EmbeddedRedis().start()
    port = server.port
    restarted: list[EmbeddedRedis] = []

    async def run() -> bytes:
        r = lean_client(server.url, 2.0)
        try:
            assert await r.execute("PING") == b"PONG"
            server.stop()
            with pytest.raises(ConnectionError):
                await r.execute("PING")
            with pytest.raises(ConnectionError):  # nothing listens: connecting fails
                await r.execute("PING")
            restarted.append(await asyncio.to_thread(EmbeddedRedis(port=port).start))
            return await r.execute("PING")
        finally:
            await r.aclose()

    try:
        assert asyncio.run(run()) == b"PONG"
    finally:
        for s in (server, *restarted):
            s.stop()


async def until(cond, what: str, deadline_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not cond():
        assert loop.time() < end, f"not {what} within {deadline_s} s"
        await asyncio.sleep(0.01)


async def cancel_mid_connect(r: LeanRedis) -> None:
    """A caller (a client that went away) is cancelled while its connect is under way."""
    t = asyncio.ensure_future(r.execute("PING"))
    await asyncio.sleep(0)  # the connect is under way
    assert r._connecting is not None and not r._connecting.done()
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)


def test_a_connect_whose_caller_was_cancelled_is_not_reused_once_lost(redis_server):
    """The connect goes on without its caller; once that connection is lost, the next
    command connects anew instead of writing to the dead one and waiting out timeout_s."""

    async def run() -> bytes:
        r = lean_client(redis_server.url, 2.0)
        try:
            await cancel_mid_connect(r)
            await until(lambda: r._proto is not None, "connected")
            assert await r.execute("PING") == b"PONG"
            redis.Redis.from_url(redis_server.url).client_kill_filter(
                _type="normal", skipme=True
            )  # the connection is lost (Redis restart, idle kill, network blip)
            await until(lambda: r._proto.lost, "lost")
            return await r.execute("PING")
        finally:
            await r.aclose()

    assert asyncio.run(run()) == b"PONG"


def test_a_failed_connect_whose_caller_was_cancelled_is_not_raised_later():
    """A connect that failed with no caller left is not raised, stale, to the next caller
    once Redis is back."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here (yet)
    started: list[EmbeddedRedis] = []

    async def run() -> bytes:
        r = LeanRedis("127.0.0.1", port, 0, None, None, timeout_s=2.0)
        try:
            await cancel_mid_connect(r)
            await until(lambda: r._connecting is None or r._connecting.done(), "refused")
            await asyncio.sleep(0.05)
            started.append(await asyncio.to_thread(EmbeddedRedis(port=port).start))
            return await r.execute("PING")
        finally:
            await r.aclose()

    try:
        assert asyncio.run(run()) == b"PONG"
    finally:
        for server in started:
            server.stop()


def test_a_server_that_does_not_answer_times_out_and_is_dropped():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts connections (backlog), never reads or answers
    port = silent.getsockname()[1]

    async def run() -> float:
        r = LeanRedis("127.0.0.1", port, 0, None, None, timeout_s=0.3)
        t0 = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                await r.execute("PING")
            return time.monotonic() - t0
        finally:
            await r.aclose()

    try:
        waited = asyncio.run(run())
    finally:
        silent.close()
    assert 0.25 <= waited < 5.0


def test_password_and_database_apply(redis_server):
    async def run() -> tuple:
        admin = lean_client(redis_server.url, 5.0)
        await admin.execute("SELECT", 3)
        await admin.execute("SET", "k", "in-db-3")
        await admin.execute("CONFIG", "SET", "requirepass", "s3cret")
        await admin.aclose()
        r = lean_client(f"redis://:s3cret@127.0.0.1:{redis_server.port}/3", 5.0)
        bad = lean_client(f"redis://:wrong@127.0.0.1:{redis_server.port}/3", 5.0)
        try:
            with pytest.raises(ResponseError):
                await bad.execute("GET", "k")
            return await r.execute("GET", "k"), await r.execute("DBSIZE")
        finally:
            await r.aclose()
            await bad.aclose()

    assert asyncio.run(run()) == (b"in-db-3", 1)


def test_read_nodes_gives_the_same_records_through_both_clients(redis_server):
    from pdserve.cluster.redis_client import connect
    from pdserve.cluster.registry import NodeRecord, read_nodes
    from pdserve.common.redis_keys import ClusterKeys

    keys = ClusterKeys("t")
    recs = [NodeRecord(node_id=f"n{i}", role=("prefill", "decode")[i % 2], url=f"http://h:{i}",
                       model="m", block_size=16, epoch=i + 1) for i in range(5)]  # fmt: skip

    async def run() -> tuple:
        py, lean = connect(redis_server.url), lean_client(redis_server.url, 5.0)
        try:
            for r in recs:
                await py.hset(keys.node(r.node_id), mapping=r.to_redis())
            await py.sadd(keys.nodes, *(r.node_id for r in recs), "expired-1")
            await py.hset(keys.node("bad"), mapping={"role": "nonsense"})
            await py.sadd(keys.nodes, "bad")
            got_lean = await read_nodes(lean, keys)
            left = await py.smembers(keys.nodes)  # the expired id was removed
            await py.sadd(keys.nodes, "expired-2")
            return got_lean, await read_nodes(py, keys), left
        finally:
            await py.aclose()
            await lean.aclose()

    got_lean, got_py, left = asyncio.run(run())
    assert got_lean == got_py == recs
    assert left == {r.node_id.encode() for r in recs} | {b"bad"}


def test_started_commands_keep_their_replies_when_one_is_cancelled(redis_server):
    """`script.start`: sent at once, awaited later; a cancelled one's reply is skipped, and a
    script Redis does not know (NOSCRIPT) is loaded when the started call is awaited."""

    async def run() -> list:
        r = lean_client(redis_server.url, 5.0)
        script = r.script("return ARGV[1]")
        try:
            await r.execute("PING")  # connected: `start` writes at once
            dropped = script.start([], ["dropped"])
            kept = [script.start([], [f"v{i}"]) for i in range(3)]
            dropped.cancel()
            out = [await p for p in reversed(kept)]
            await r.execute("SCRIPT", "FLUSH")
            out.append(await script.start([], ["after flush"]))
            out.append(await r.execute("ECHO", "in step"))
            return out
        finally:
            await r.aclose()

    assert asyncio.run(run()) == [b"v2", b"v1", b"v0", b"after flush", b"in step"]


def test_a_start_before_connecting_connects_when_awaited(redis_server):
    async def run() -> bytes:
        r = lean_client(redis_server.url, 5.0)
        try:
            return await r.script("return 'ok'").start([], [])
        finally:
            await r.aclose()

    assert asyncio.run(run()) == b"ok"

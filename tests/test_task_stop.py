"""Stopping background tasks within a deadline (pdserve/common/task_stop.py), and a node's
registry agent that leaves within its own (node/cluster_agent.py).

CI saw a node whose EngineCore was SIGKILLed stay up for good with a dead engine: its
registry heartbeat swallowed the cancel of the stop (Python 3.11's `asyncio.wait_for`,
which redis-py runs each command under, hides a cancel that lands as its inner future
ends: CPython gh-86296, fixed in 3.12), so `await task` never returned and the node never
sent itself the SIGTERM that ends it."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import redis

from pdserve.common.task_stop import cancel_and_wait
from pdserve.engine.config import EngineConfig, KVTransferConfig, ModelConfig
from pdserve.node.cluster_agent import LEAVE_TIMEOUT_S, ClusterAgent, ClusterOptions


async def _swallows_cancels(stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            pass  # what the wait_for race does, every time


def test_a_task_that_swallows_its_cancel_is_left_behind_at_the_deadline():
    async def main():
        stop = asyncio.Event()
        stubborn = asyncio.create_task(_swallows_cancels(stop), name="stubborn")
        polite = asyncio.create_task(asyncio.sleep(60), name="polite")
        failing = asyncio.create_task(asyncio.sleep(0), name="failing")
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        left = await cancel_and_wait([stubborn, polite, failing], 0.3)
        waited = time.monotonic() - t0
        assert left == [stubborn] and not stubborn.done()
        assert polite.cancelled()
        stop.set()
        await stubborn
        return waited

    waited = asyncio.run(main())
    assert 0.3 <= waited < 2.0  # the deadline, not forever


class _Engine:
    """The part of AsyncLLM the agent reads (an engine that has cached nothing yet)."""

    def __init__(self) -> None:
        self.info = None
        self.client = SimpleNamespace(latest_stats=None, get_cached_hashes=self._hashes)

    async def _hashes(self) -> list[bytes]:
        return []


def test_agent_stops_within_its_deadline_and_never_registers_again(redis_server):
    """Heartbeats every 5 ms, so stops land inside redis-py commands: every stop returns
    within LEAVE_TIMEOUT_S, and once it has, the node's record is gone for good (a
    heartbeat left behind writes nothing more)."""
    sync = redis.Redis.from_url(redis_server.url)

    async def one(i: int) -> float:
        config = EngineConfig(
            model=ModelConfig(name="m"),
            kv_transfer=KVTransferConfig(role="decode", node_id=f"decode-{i}"),
        )
        opts = ClusterOptions(
            "http://127.0.0.1:1", redis_server.url, "stops", heartbeat_s=0.005, node_ttl_s=30
        )
        agent = ClusterAgent(config, _Engine(), opts)
        await agent.start()
        while not sync.exists(agent.keys.node(agent.node_id)):
            await asyncio.sleep(0.005)
        await asyncio.sleep(random.random() * 0.05)
        t0 = time.monotonic()
        await asyncio.wait_for(agent.stop(), LEAVE_TIMEOUT_S + 2)  # hung forever before
        took = time.monotonic() - t0
        await asyncio.sleep(0.1)  # 20 heartbeats' time: none may write the record again
        assert not sync.exists(agent.keys.node(agent.node_id)), f"stop {i}: registered again"
        return took

    async def main() -> list[float]:
        return [await one(i) for i in range(40)]

    took = asyncio.run(main())
    assert max(took) < LEAVE_TIMEOUT_S + 0.5, took

"""The embedded redis-server: a real server on loopback that leaves no process behind."""

from __future__ import annotations

import os

import pytest
import redis

from pdserve.cluster.embedded_redis import EmbeddedRedis, RedisUnavailableError


def test_serves_and_stops_without_leftovers(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.set("k", "v")
    assert client.get("k") == b"v"
    assert redis_server.url.startswith("redis://127.0.0.1:")
    pid = redis_server.proc.pid
    redis_server.stop()
    assert not os.path.exists(f"/proc/{pid}")
    assert not redis_server.ping()


def test_port_in_use_is_a_clear_error(redis_server):
    with pytest.raises(RedisUnavailableError, match=str(redis_server.port)):
        EmbeddedRedis(port=redis_server.port).start(timeout_s=5)


def test_missing_executable_is_a_clear_error():
    with pytest.raises(RedisUnavailableError, match="not found"):
        EmbeddedRedis(executable="no-such-redis-server").start()

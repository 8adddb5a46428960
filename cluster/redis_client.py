"""The asyncio Redis client of the router's hot path: redis-py with hiredis on both ends.

redis-py parses replies with hiredis when it is installed, but its asyncio connection packs
every command in Python (one `encode` per argument). A KV index lookup sends ~130
arguments (a key per candidate node, a hash per prompt block), so packing cost the router
more CPU than the whole policy step; `connect()` gives connections that pack with
`hiredis.pack_command` instead (redis-py's own serializer for its sync client).
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.connection import Connection

try:
    from redis.connection import HiredisRespSerializer
    from redis.utils import HIREDIS_AVAILABLE
except ImportError:  # an older or newer redis-py without it: plain packing
    HIREDIS_AVAILABLE = False


if HIREDIS_AVAILABLE:

    class HiredisPackConnection(Connection):
        """A TCP connection whose commands are packed in C."""

        _packer = HiredisRespSerializer()

        def pack_command(self, *args) -> list[bytes]:
            return self._packer.pack(*args)


def connect(url: str, **kwargs) -> Redis:
    """`Redis.from_url(url, **kwargs)`, packing in C for plain `redis://` URLs."""
    if HIREDIS_AVAILABLE and url.startswith("redis://"):
        kwargs.setdefault("connection_class", HiredisPackConnection)
    return Redis.from_url(url, **kwargs)

"""The asyncio Redis client of the router's hot path: redis-py with hiredis on both ends.

redis-py parses replies with hiredis when it is installed, but its asyncio connection packs
every command in Python (one `encode` per argument). A KV index lookup sends ~130
arguments (a key per candidate node, a hash per prompt block), so packing cost the router
more CPU than the whole policy step; `connect()` gives connections that pack with
`hiredis.pack_command` in one call instead.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.connection import Connection

try:
    import hiredis
except ImportError:  # plain packing
    hiredis = None


class HiredisPackConnection(Connection):
    """A TCP connection whose commands are packed in C (str, bytes, int, float arguments;
    anything else goes the plain way, which raises redis-py's own errors)."""

    def pack_command(self, *args) -> list[bytes]:
        if isinstance(args[0], str) and " " in args[0]:  # "CONFIG GET": words go apart
            args = (*args[0].split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:
            return super().pack_command(*args)


def connect(url: str, **kwargs) -> Redis:
    """`Redis.from_url(url, **kwargs)`, packing in C for plain `redis://` URLs."""
    if hiredis is not None and url.startswith("redis://"):
        kwargs.setdefault("connection_class", HiredisPackConnection)
    return Redis.from_url(url, **kwargs)

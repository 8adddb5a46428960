"""Build a KV connector by name: the one place that knows every connector.

It sits above the connectors (base.py, the sides and the transports never import it),
so the contract in base.py knows no implementation. Each connector module is imported
only when asked for: NIXL and LMCache load heavy libraries.
"""

from __future__ import annotations

from pdserve.kv_transfer.base import DecodeConnector, PrefillConnector

KNOWN = ("nixl", "lmcache")


def create_connector(name: str, **kwargs) -> DecodeConnector | PrefillConnector:
    """The `name` connector for one node (`kwargs`: its factory's keyword arguments)."""
    if name == "nixl":
        from pdserve.kv_transfer.nixl_connector import nixl_connector as factory
    elif name == "lmcache":
        from pdserve.kv_transfer.lmcache_connector import lmcache_connector as factory
    else:
        raise ValueError(f"unknown KV connector {name!r}; known: {', '.join(KNOWN)}")
    return factory(**kwargs)

"""The Redis key layout of a cluster: every key name is built here, nowhere else.

All keys live under one cluster prefix (`--cluster`, default `pdserve`):

    {prefix}:nodes                 set of node ids ever registered (a hint; may hold dead ids)
    {prefix}:node:{id}             hash: one `NodeRecord` (cluster/registry.py), refreshed by
                                   each heartbeat, with a TTL: a silent node disappears
    {prefix}:kv:{id}:{epoch}       set: the block hashes in that node's prefix cache during
                                   that boot (cluster/kv_index.py); same TTL as the record
    {prefix}:kv:store:{store_id}   set: the block hashes saved to a shared KV store
    {prefix}:launcher              string: the launcher's state (cluster.json), for `status`

A node that restarts gets a new epoch, so its old index set is never read again and ages
out. Stdlib only: the router, the nodes, tools and tests all import it.
"""

from __future__ import annotations

DEFAULT_CLUSTER = "pdserve"


class ClusterKeys:
    """Key names under one cluster prefix."""

    def __init__(self, prefix: str = DEFAULT_CLUSTER):
        if not prefix or any(c in prefix for c in " \t\n"):
            raise ValueError(f"cluster name {prefix!r} must be non-empty, without whitespace")
        self.prefix = prefix

    @property
    def nodes(self) -> str:
        return f"{self.prefix}:nodes"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}:node:{node_id}"

    @property
    def node_pattern(self) -> str:
        """A SCAN pattern matching every node record."""
        return f"{self.prefix}:node:*"

    def kv(self, node_id: str, epoch: int | str) -> str:
        return f"{self.prefix}:kv:{node_id}:{epoch}"

    @property
    def kv_pattern(self) -> str:
        """A SCAN pattern matching every KV index set (nodes' and stores')."""
        return f"{self.prefix}:kv:*"

    def kv_store(self, store_id: str) -> str:
        return f"{self.prefix}:kv:store:{store_id}"

    @property
    def launcher(self) -> str:
        return f"{self.prefix}:launcher"

"""Choose the decode node and the prefill node for one request.

1. Candidates: usable decode-capable nodes (decode or colocated) and usable prefill nodes,
   minus the nodes a failed earlier attempt excluded.
2. If either role's policy is `kv_aware` and Redis is up, read from the KV index, in one
   round trip, how many leading blocks of the prompt each candidate holds (the chain is
   hashed once per distinct model and block size, pdserve/common/block_hash.py).
3. Pick the decode node. A colocated node, or a decode node whose own cache leaves an
   uncached suffix of at most its `local_prefill_max_tokens`, prefills locally (no
   prefill node); otherwise pick the prefill node.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from pdserve.cluster.kv_index import PendingHits, PrefixHits
from pdserve.cluster.registry import NodeRecord
from pdserve.common.block_hash import hash_prompt_blocks, root_hash
from pdserve.router.config import RouterConfig
from pdserve.router.membership import Membership
from pdserve.router.nodes import ClusterView, NodeState
from pdserve.router.policies import Context, make_policy

logger = logging.getLogger(__name__)


@dataclass
class Choice:
    """A `select` begun: candidates chosen, KV index lookup in flight."""

    decodes: list[NodeState]
    prefills: list[NodeState]
    pending: PendingHits | None
    begin_s: float

    def cancel(self) -> None:
        """Not finished after all (the request was refused): drop the lookup's answer."""
        if self.pending is not None:
            self.pending.cancel()


@dataclass
class Decision:
    decode: NodeState
    prefill: NodeState | None
    prompt_blocks: int  # full blocks of the prompt under the decode node's block size
    predicted_hit_tokens: int  # prompt tokens the decode node should find in its own cache
    decision_s: float
    hits: dict[str, int] = field(default_factory=dict)


class Selector:
    def __init__(self, config: RouterConfig, view: ClusterView, membership: Membership):
        self.config = config
        self.view = view
        self.membership = membership
        w, t = config.overlap_weight, config.kv_temperature
        self.decode_policy = make_policy(config.decode_policy, "decode", w, t)
        self.prefill_policy = make_policy(config.prefill_policy, "prefill", w, t)
        self.kv_aware = "kv_aware" in (config.decode_policy, config.prefill_policy)
        self.mean_prompt_blocks = 8.0  # running mean, for queue estimates
        # unsalted roots by (model, block size, weights digest); salted: per request
        self._roots: dict[tuple[str, int, str], bytes] = {}
        self._hits: PrefixHits | None = None
        self._hits_redis = None

    def _root(self, model: str, block_size: int, weights: str, salt: str = "") -> bytes:
        if salt:  # clients choose salts: not cached (one blake2b per request)
            return root_hash(model, block_size, salt, weights)
        key = (model, block_size, weights)
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = root_hash(model, block_size, "", weights)
        return root

    def start_hits(
        self, tokens: list[int], nodes: list[NodeState], salt: str = ""
    ) -> PendingHits | None:
        """The KV index lookup for `nodes`, its command sent now (None: no lookup: not
        kv_aware, Redis down or absent); hashes chain from the request's `cache_salt` root."""
        redis = self.membership.lookup_redis or self.membership.redis
        if not self.kv_aware or redis is None or not self.membership.redis_ok or not nodes:
            return None
        chains: dict[tuple[str, int, str], list[bytes]] = {}

        def chain_of(rec: NodeRecord) -> list[bytes]:
            key = (rec.model, rec.block_size, rec.weights)
            if key not in chains:
                chains[key] = hash_prompt_blocks(tokens, rec.block_size, self._root(*key, salt))
            return chains[key]

        if self._hits is None or self._hits_redis is not redis:
            self._hits, self._hits_redis = PrefixHits(redis, self.membership.keys), redis
        return self._hits.start([n.record for n in nodes], chain_of)

    async def _hits_of(self, pending: PendingHits | None, nodes: list[NodeState]) -> dict[str, int]:
        """Node url -> leading prompt blocks it holds ({} without a lookup, or if it failed)."""
        if pending is None:
            return {}
        try:
            hits = await pending.result()
        except (RedisError, OSError) as e:
            logger.warning("KV index lookup failed (%s): load-only routing", e)
            self.membership.redis_ok = False
            return {}
        by_id = {n.record.node_id: n for n in nodes}
        return {by_id[i].url: h for i, h in hits.items() if i in by_id}

    async def lookup_hits(
        self, tokens: list[int], nodes: list[NodeState], salt: str = ""
    ) -> dict[str, int]:
        """Node url -> leading prompt blocks it holds ({} without Redis)."""
        return await self._hits_of(self.start_hits(tokens, nodes, salt), nodes)

    def begin(self, tokens: list[int], exclude: set[str], salt: str = "") -> Choice | None:
        """The first half of `select`: the candidates, and their KV index lookup sent (the
        caller may work while Redis answers); None when no decode-capable node is usable."""
        t0 = time.perf_counter()
        decodes = [n for n in self.view.usable(True) if n.url not in exclude]
        if not decodes:
            return None
        prefills = [n for n in self.view.usable(False) if n.url not in exclude]
        pending = self.start_hits(tokens, decodes + prefills, salt)
        return Choice(decodes, prefills, pending, time.perf_counter() - t0)

    async def select(self, tokens: list[int], exclude: set[str], salt: str = "") -> Decision | None:
        """The nodes for this request, or None when no decode-capable node is usable."""
        choice = self.begin(tokens, exclude, salt)
        return None if choice is None else await self.finish(tokens, choice)

    async def finish(self, tokens: list[int], choice: Choice) -> Decision:
        """The second half of `select`: the lookup's answer, then the policies. The decision
        time counts both halves, not the time the caller spent between them."""
        t0 = time.perf_counter()
        decodes, prefills = choice.decodes, choice.prefills
        hits = await self._hits_of(choice.pending, decodes + prefills)
        bs = decodes[0].record.block_size
        blocks = len(tokens) // bs
        ctx = Context(blocks, hits, self.mean_prompt_blocks)
        decode = self.decode_policy(decodes, ctx)
        rec = decode.record
        prefill = None
        hit_d = hits.get(decode.url, 0)
        predicted = min(hit_d * rec.block_size, len(tokens) - 1)
        local = rec.role == "colocated" or (
            len(tokens) - hit_d * rec.block_size <= rec.local_prefill_max_tokens
        )
        if not local and prefills:
            prefill = self.prefill_policy(prefills, ctx)
        self.mean_prompt_blocks = 0.95 * self.mean_prompt_blocks + 0.05 * blocks
        decision_s = choice.begin_s + time.perf_counter() - t0
        return Decision(decode, prefill, blocks, max(predicted, 0), decision_s, hits)

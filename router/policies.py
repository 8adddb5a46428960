"""Node-selection policies, one per role: `round_robin`, `least_loaded`, `kv_aware`.

Each policy picks one node out of a non-empty candidate list, given per node the number of
leading prompt blocks it already holds (`hits`, from the KV index; empty when Redis is
down or the policy does not look). Loads combine what the registry last said (updated each
heartbeat) and what this router has in flight on the node, taking the larger of the two
so that neither a stale record nor another router's traffic is ignored.

`kv_aware` cost, in KV blocks (lower is better; ties go to the less loaded, then in turn):

    prefill node p:  w * (B - hit_p)  +  queued_p
    decode node d:   (B - hit_d)      +  active_d

B is the prompt's full blocks; w is `overlap_weight`. `B - hit_p` is what p must compute
(its own prefix cache skips the rest); `queued_p` estimates the prompt blocks already
waiting for p (in-flight prefills, or registry running+waiting times the mean prompt).
`B - hit_d` is what has to move into d (its own cached prefix needs no transfer and no new
blocks); `active_d` is the KV d already holds for running requests. Dynamo's cost is
`overlap_weight x new prefill blocks + active decode blocks` over one worker; splitting it
per role lets the decode choice count d's own prefix and the prefill choice p's.

`kv_temperature` T (config, in KV blocks): T = 0 picks the cheapest node (ties as above);
T > 0 samples node i with probability softmax(-cost_i / T), as Dynamo's router does, so
that near-equal nodes share the work instead of one taking every request until its load
catches up: a node that costs T more blocks than another is e times less likely.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

from pdserve.router.nodes import NodeState

Policy = Callable[[list[NodeState], "Context"], NodeState]


class Context:
    """What a policy may look at for one request."""

    def __init__(self, prompt_blocks: int, hits: dict[str, int], mean_prompt_blocks: float):
        self.prompt_blocks = prompt_blocks
        self.hits = hits  # node url -> leading blocks held
        self.mean_prompt_blocks = mean_prompt_blocks


def _requests_load(n: NodeState) -> float:
    r = n.record
    reg = (r.running + r.waiting) if r else 0
    kv = r.kv_used / r.kv_total if r and r.kv_total else 0.0
    return max(n.inflight, reg) + kv


def prefill_queue_blocks(n: NodeState, ctx: Context) -> float:
    r = n.record
    reg = (r.running + r.waiting) * ctx.mean_prompt_blocks if r else 0.0
    return max(float(n.prefill_blocks), reg)


def decode_active_blocks(n: NodeState) -> float:
    r = n.record
    return float(max(n.inflight_blocks, r.kv_used if r else 0))


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def __call__(self, nodes: list[NodeState], ctx: Context) -> NodeState:
        ordered = sorted(nodes, key=lambda n: n.url)
        return ordered[next(self._counter) % len(ordered)]


class LeastLoaded:
    """Power of two choices: the less loaded of two random candidates."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def __call__(self, nodes: list[NodeState], ctx: Context) -> NodeState:
        if len(nodes) == 1:
            return nodes[0]
        a, b = self._rng.sample(nodes, 2)
        return a if _requests_load(a) <= _requests_load(b) else b


class KVAware:
    def __init__(
        self,
        role: str,
        overlap_weight: float = 1.0,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> None:
        self.role = role
        self.w = overlap_weight
        self.temperature = temperature
        self._rr = itertools.count()
        self._rng = random.Random(seed)

    def cost(self, n: NodeState, ctx: Context) -> float:
        missing = max(0, ctx.prompt_blocks - ctx.hits.get(n.url, 0))
        if self.role == "prefill":
            return self.w * missing + prefill_queue_blocks(n, ctx)
        return missing + decode_active_blocks(n)

    def probabilities(self, costs: list[float]) -> list[float]:
        """softmax(-cost / T) (T > 0), shifted by the cheapest cost so exp never overflows."""
        best, t = min(costs), self.temperature
        weights = [math.exp((best - c) / t) for c in costs]
        total = sum(weights)
        return [w / total for w in weights]

    def __call__(self, nodes: list[NodeState], ctx: Context) -> NodeState:
        turn = next(self._rr)
        costs = [self.cost(n, ctx) for n in nodes]
        if self.temperature > 0 and len(nodes) > 1:
            return self._rng.choices(nodes, weights=self.probabilities(costs))[0]
        best = min(costs)
        tied = [n for n, c in zip(nodes, costs) if c == best]
        if len(tied) == 1:
            return tied[0]
        # ties: the less loaded, then in turn (by url, so every router rotates alike)
        loads = [_requests_load(n) for n in tied]
        low = min(loads)
        tied = sorted((n for n, ld in zip(tied, loads) if ld == low), key=lambda n: n.url)
        return tied[turn % len(tied)]


def make_policy(
    name: str, role: str, overlap_weight: float = 1.0, temperature: float = 0.0
) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "kv_aware":
        return KVAware(role, overlap_weight, temperature)
    raise ValueError(f"unknown policy {name!r}")

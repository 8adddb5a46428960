"""The KV connector contract: how a prompt's KV gets from a prefill node to a decode node.

A connector has two sides, each driven from its node's engine thread between steps (no
method blocks; results come back from `poll()` as typed events).

Decode side (consumer):
  * `request_prefill(order, prefill_node)`: ask `prefill_node` to compute the prompt and
    deliver its KV into `order.dst_block_ids`. Exactly one terminal event follows for the
    request: `RecvDone` (every block landed; decode may use the KV) or `RecvFailed`
    (rejected, peer error, deadline passed). After `RecvFailed` or `cancel`, the blocks
    may still receive a late write: keep them out of circulation until `Released`.
  * `cancel(request_id)`: stop a transfer (client abort, deadline); a `Released` event
    follows once the prefill node acknowledged, or its deadline plus a grace period passed.

Prefill side (producer):
  * `poll()` yields `NewOrder` (compute this prompt; push its blocks) and `OrderAborted`.
  * `send_blocks(request_id, src_block_ids, first_index)`: push finished blocks now
    (transfer overlaps the rest of the prefill). `first_index` is the prompt-block index
    of `src_block_ids[0]`; the connector maps it to the decode node's block ids.
  * `finish(request_id, src_block_ids, first_index, first_token, logprob)`: push the last
    blocks and, once every block of the request has landed, tell the decode node.
    A terminal `SendDone` or `SendFailed` follows; only then may the blocks be freed.
  * `settle_abort(request_id)`: the prefill node dropped an aborted order; the connector
    acknowledges to the decode node once nothing of the request is in flight, then
    emits `SendFailed`.

Worker side: `register_kv_cache(kv_cache)` once, before anything else.
`check_integrity()` raises if any transfer table is inconsistent; `close()` is idempotent.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import msgspec
import torch

from kv_transfer.messages import PrefillOrder


class RecvDone(msgspec.Struct, frozen=True):
    request_id: str
    first_token: int
    logprob: float | None
    num_blocks: int


class RecvFailed(msgspec.Struct, frozen=True):
    request_id: str
    reason: str


class Released(msgspec.Struct, frozen=True):
    request_id: str


class NewOrder(msgspec.Struct, frozen=True):
    order: PrefillOrder


class OrderAborted(msgspec.Struct, frozen=True):
    request_id: str


class SendDone(msgspec.Struct, frozen=True):
    request_id: str
    bytes: int
    descriptors: int
    seconds: float


class SendFailed(msgspec.Struct, frozen=True):
    request_id: str
    reason: str


KVEvent = RecvDone | RecvFailed | Released | NewOrder | OrderAborted | SendDone | SendFailed


class KVConnector(abc.ABC):
    # -- worker side
    @abc.abstractmethod
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def poll(self) -> list[KVEvent]: ...

    # -- decode side
    @abc.abstractmethod
    def request_prefill(self, order: PrefillOrder, prefill_node: str) -> None: ...

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None: ...

    # -- prefill side
    @abc.abstractmethod
    def send_blocks(self, request_id: str, src_block_ids: list[int], first_index: int) -> None: ...

    @abc.abstractmethod
    def finish(
        self,
        request_id: str,
        src_block_ids: list[int],
        first_index: int,
        first_token: int,
        logprob: float | None,
    ) -> None: ...

    @abc.abstractmethod
    def settle_abort(self, request_id: str) -> None: ...

    # -- both
    @abc.abstractmethod
    def has_pending(self) -> bool: ...

    @property
    @abc.abstractmethod
    def local_name(self) -> str:
        """This node's name on the data channel (what a peer addresses its writes to)."""

    def wait_sockets(self) -> list:
        """ZMQ sockets that become readable when poll() has something new (may be empty)."""
        return []

    @abc.abstractmethod
    def check_integrity(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


_REGISTRY: dict[str, Callable[..., KVConnector]] = {}


def register_connector(name: str):
    def deco(factory):
        _REGISTRY[name] = factory
        return factory

    return deco


def create_connector(name: str, **kwargs) -> KVConnector:
    if name == "nixl":
        import kv_transfer.nixl_connector  # noqa: F401  (registers itself)
    if name not in _REGISTRY:
        raise ValueError(f"unknown KV connector {name!r}; known: {sorted(_REGISTRY) or ['nixl']}")
    return _REGISTRY[name](**kwargs)

"""The KV connector contract: how a prompt's KV gets from a prefill node to a decode node.

A connector is one side of a transfer, driven from its node's engine thread between
steps. No method blocks or raises for a peer's sake: a peer's failure comes back from
`poll()` as a typed event naming the transfer. Transfers are keyed by
`TransferKey = (request_id, attempt)`; a retry is a new attempt with new blocks.

Decode side (`DecodeConnector`, consumer):
  * `request_prefill(order, prefill_node)`: ask `prefill_node` to compute the prompt and
    deliver its KV into `order.dst_block_ids`. Exactly one of `RecvDone` (every block
    landed) or `RecvFailed` (rejected, peer dead or unreachable, WRITE failed, deadline)
    follows for the attempt, and exactly one `Released` (no WRITE of the attempt can land
    any more: the blocks may be reused); `RecvDone` implies `Released` and comes alone.
  * `cancel(key)`: stop an attempt (client abort); `Released` follows once the prefill
    node acknowledged, or once its connection was fenced and the last lease on it ran
    out (never because a deadline passed: kv_transfer/decode_side.py).
  * `peer_alive(node)`: False while the prefill node misses heartbeats or its engine is
    stuck (fail over).

Prefill side (`PrefillConnector`, producer):
  * `poll()` yields `NewOrder` (compute this prompt; push its blocks) and `OrderAborted`
    (the decode node aborted, or the order expired, before it finished).
  * `send_blocks(key, src_block_ids, first_index)`: push finished blocks now.
  * `finish(key, src_block_ids, first_index, first_token, logprob, ...)`: push the last
    blocks and, once every block has landed, tell the decode node (with the first token's
    logprobs and the prompt logprobs the order asked for).
  * `end(key, reason)`: the prefill node dropped the attempt (abort, error, out of
    blocks); the decode node is told once nothing of it is in flight.
  * `reject(order, reason)`: a `NewOrder` the engine could not take.
  * `flush(timeout_s)`: progress posted WRITEs (and the done notifications they carry)
    for at most `timeout_s`, before the engine starts a step that polls nothing.
  After `NewOrder`, exactly one `SendDone` or `SendFailed` follows per attempt, once no
  WRITE of it is in flight (or its deadline, counted from receipt, plus grace passed):
  only then may the source blocks be reused.

Worker side: `register_kv_cache(kv_cache)` once, before anything else.
`check_integrity()` raises if any transfer table is inconsistent; `close()` is idempotent.

Composition: a node's transfer connector and its prefix stores (the engine's `KVStore`
hooks, engine/kv_store.py) are one `MultiConnector` (kv_transfer/multi_connector.py),
built from the node's ordered `kv_backends`: load from the first that has it, save to
every backend that should.
"""

from __future__ import annotations

import abc

import msgspec
import torch

from pdserve.engine.outputs import TokenLogprobs
from pdserve.kv_transfer.messages import PrefillOrder

TransferKey = tuple[str, int]  # (request id, attempt)


class RecvDone(msgspec.Struct, frozen=True):
    key: TransferKey
    first_token: int
    logprob: float | None
    num_blocks: int
    prefill_node_s: tuple[float, float] = (0.0, 0.0)  # the prefill node's queue, compute
    top: TokenLogprobs | None = None  # the first token's, if the order asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # if the order asked (checked)
    checksums: list[int] | None = None  # the sender's, per block, if the order asked


class RecvFailed(msgspec.Struct, frozen=True):
    key: TransferKey
    reason: str
    checksum_mismatch: bool = False  # the blocks landed but did not match their checksums


class Released(msgspec.Struct, frozen=True):
    key: TransferKey


class NewOrder(msgspec.Struct, frozen=True):
    order: PrefillOrder
    # How long the order sat unread before the prefill node's loop saw it (it reads orders
    # between steps, so during a long step they wait): part of the prefill queue.
    waited_s: float = 0.0

    @property
    def key(self) -> TransferKey:
        return (self.order.request_id, self.order.attempt)


class OrderAborted(msgspec.Struct, frozen=True):
    key: TransferKey
    reason: str


class SendDone(msgspec.Struct, frozen=True):
    key: TransferKey
    bytes: int
    descriptors: int
    seconds: float


class SendFailed(msgspec.Struct, frozen=True):
    key: TransferKey
    reason: str


DecodeEvent = RecvDone | RecvFailed | Released
PrefillEvent = NewOrder | OrderAborted | SendDone | SendFailed


class _Connector(abc.ABC):
    @abc.abstractmethod
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None: ...

    @property
    @abc.abstractmethod
    def local_name(self) -> str:
        """This node's name on the data channel (what a peer addresses its writes to)."""

    @abc.abstractmethod
    def has_pending(self) -> bool: ...

    def wait_sockets(self) -> list:
        """ZMQ sockets that become readable when poll() has something new (may be empty)."""
        return []

    @abc.abstractmethod
    def check_integrity(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class DecodeConnector(_Connector):
    vocab_size: int | None = None  # the model's, set on attach: a peer's token ids are checked
    num_bad_dones: int = 0  # PrefillDones that failed their checks (a broken or hostile peer)
    num_checksum_mismatches: int = 0  # attempts whose landed blocks failed their checksums
    num_data_fences: int = 0  # times every incoming data-plane connection was dropped

    @abc.abstractmethod
    def poll(self) -> list[DecodeEvent]: ...

    @abc.abstractmethod
    def request_prefill(self, order: PrefillOrder, prefill_node: str) -> None: ...

    @abc.abstractmethod
    def cancel(self, key: TransferKey) -> None: ...

    @abc.abstractmethod
    def peer_alive(self, prefill_node: str) -> bool: ...


class PrefillConnector(_Connector):
    @abc.abstractmethod
    def poll(self) -> list[PrefillEvent]: ...

    @abc.abstractmethod
    def send_blocks(self, key: TransferKey, src_block_ids: list[int], first_index: int) -> None: ...

    @abc.abstractmethod
    def finish(
        self,
        key: TransferKey,
        src_block_ids: list[int],
        first_index: int,
        first_token: int,
        logprob: float | None,
        prefill_node_s: tuple[float, float] = (0.0, 0.0),
        top: TokenLogprobs | None = None,
        prompt_logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        """Push the last blocks, then tell decode (with this node's queue and compute
        seconds, `prefill_node_s`, for the TTFT breakdown, and the first token's `top`
        alternatives and the `prompt_logprobs` when the order asked for them)."""

    @abc.abstractmethod
    def end(self, key: TransferKey, reason: str) -> None: ...

    @abc.abstractmethod
    def reject(self, order: PrefillOrder, reason: str) -> None: ...

    def flush(self, timeout_s: float) -> None:
        """Progress in-flight WRITEs until none is pending or `timeout_s` passes."""
        return None

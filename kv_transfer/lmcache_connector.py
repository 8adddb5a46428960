"""The LMCache KV connector: PD through the shared store instead of point-to-point WRITEs.

The same PD contract as the NIXL connector (`pdserve.kv_transfer.base`), the same control channel
and the same state machines (`DecodeSide`, `PrefillSide`); only the data moves another
way (`pdserve.kv_transfer.lmcache_transport`):

    decode                                   prefill
    PeerHello (layout only), PrefillOrder -> compute the prompt (chunk-aligned start);
                                             store each whole chunk as it is computed,
                                             the rest at finish; wait until Redis holds
                                             all of them (deadline: the order's)
                     <- PrefillDone (control) once visible; PrefillFailed if not
    retrieve the chunks by token ids into
    the ordered blocks (a worker job)
    every prompt token present -> RecvDone; else RecvFailed (fail over)

Completeness: the decode side uses the KV only when the retrieve filled every prompt
token from the order's first block on. Deadlines: the order's `ttl_s` (each side's own
deadline on its own monotonic clock) bounds the prefill's store, the wait for `PrefillDone` and the retrieve; at it the attempt fails
(`RecvFailed`, fail over), and its blocks are released once no retrieve writes them
(`Released` waits for the job to end). Abort: an attempt cancelled mid-retrieve is
released when the job ends; one cancelled before is aborted at the prefill node as with
NIXL. The prefill node stores from the first chunk boundary at or before the order's
first block (LMCache keys whole chunks), so its `NewOrder` asks the engine for blocks
from there.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass

import msgspec
import torch

from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.base import (
    DecodeEvent,
    NewOrder,
    PrefillEvent,
    RecvDone,
    RecvFailed,
    Released,
    TransferKey,
)
from pdserve.kv_transfer.control_channel import DecodeControl, PrefillControl
from pdserve.kv_transfer.decode_side import DecodeSide, RecvState, _Attempt
from pdserve.kv_transfer.frame_auth import FrameAuth
from pdserve.kv_transfer.prefill_side import PrefillSide, SendState, _Send
from pdserve.kv_transfer.transfer_types import TransferHandle, TransferState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LMCacheSettings:
    remote_url: str  # the Redis both nodes reach
    namespace: str  # chunk key prefix (the model's name)
    chunk_size: int = 256
    local_cpu_bytes: int = 256 << 20


def _data_factory(node_id: str, s: LMCacheSettings):
    def build(kv_cache: torch.Tensor):
        from pdserve.kv_transfer.lmcache_store import LMCacheKVStore
        from pdserve.kv_transfer.lmcache_transport import LMCacheDataPlane
        from pdserve.kv_transfer.prefix_store import redis_health_check

        def backend(cache):
            return LMCacheKVStore(
                cache,
                namespace=s.namespace,
                chunk_size=s.chunk_size,
                local_cpu_bytes=s.local_cpu_bytes,
                remote_url=s.remote_url,
            )

        name = f"{node_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        return LMCacheDataPlane(name, kv_cache, backend, redis_health_check(s.remote_url))

    return build


def _slots(
    order: m.PrefillOrder, block_ids: list[int], first: int, bs: int, end: int | None = None
) -> list[int]:
    """Slot of every prompt token before `end` (default: all): blocks `block_ids` hold
    prompt blocks first, first+1, ...; tokens before block `first` get -1 (not touched)."""
    n = len(order.prompt_token_ids) if end is None else end
    slots = [-1] * (first * bs)
    for t in range(first * bs, n):
        slots.append(block_ids[t // bs - first] * bs + t % bs)
    return slots


class LMCacheDecodeSide(DecodeSide):
    """Orders prefills over the control channel; retrieves their KV from the store."""

    peer_writes = False  # only our own retrieve writes the blocks (`_loading`)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # attempts whose retrieve runs: (attempt, its handle, the RecvDone it will give)
        self._loading: dict[TransferKey, tuple[_Attempt, TransferHandle, RecvDone]] = {}

    def _on_control(self, node: str, msg: m.ToDecode) -> list[DecodeEvent]:
        if not isinstance(msg, m.PrefillDone):
            return super()._on_control(node, msg)
        key = (msg.request_id, msg.attempt)
        att = self._attempts.get(key)
        if att is None or att.node != node:
            return []  # stale, or not from the node we ordered from
        events = self._on_done(node, msg)  # the NIXL checks: nonce, block count, logprobs
        if not (len(events) == 1 and isinstance(events[0], RecvDone)):
            return events
        o = att.order
        if self.clock() > att.deadline:
            return [RecvFailed(key, "the KV was stored after the deadline"), Released(key)]
        slots = _slots(o, o.dst_block_ids, o.first_block, self._data.layout.block_size)
        skip = o.first_block * self._data.layout.block_size
        handle = self._data.retrieve(o.prompt_token_ids, slots, skip, att.deadline)
        self._loading[key] = (att, handle, events[0])  # RecvDone once every token is in
        return []

    def poll(self) -> list[DecodeEvent]:
        events = super().poll()
        now = self.clock()
        for key, (att, handle, done) in list(self._loading.items()):
            state = self._data.poll(handle)
            if state is TransferState.PENDING:
                if att.state is RecvState.ORDERED and now > att.deadline:
                    att.state = RecvState.FAILED  # fail over now; release when it ends
                    logger.warning("request %s (attempt %d): retrieve missed the deadline", *key)
                    events.append(RecvFailed(key, "the KV retrieve missed the deadline"))
                continue
            del self._loading[key]
            present = self._data.present(handle)
            self._data.release(handle)
            n = len(att.order.prompt_token_ids)
            if att.state is not RecvState.ORDERED:
                events.append(Released(key))
            elif state is TransferState.DONE and present >= n:
                events += self._verify(key, att, done.checksums) or [done]
            else:
                reason = f"incomplete KV in the store: {present} of {n} prompt tokens"
                logger.warning("request %s (attempt %d): %s", *key, reason)
                events += [RecvFailed(key, reason), Released(key)]
        return events

    def cancel(self, key: TransferKey) -> None:
        loading = self._loading.get(key)
        if loading is None:
            return super().cancel(key)
        if loading[0].state is RecvState.ORDERED:
            loading[0].state = RecvState.CANCELLED  # Released when the retrieve ends

    def has_pending(self) -> bool:
        return bool(self._loading) or super().has_pending()

    def check_integrity(self) -> None:
        if self.data is None:
            return
        self.data.check_integrity()
        if self.data.num_inflight != len(self._loading):
            raise RuntimeError(
                f"{self.data.num_inflight} LMCache jobs, {len(self._loading)} retrieves tracked"
            )


class LMCachePrefillSide(PrefillSide):
    """Takes orders over the control channel; stores the prompt's chunks, then says done.

    Stores are pipelined with the prompt's compute: each whole chunk is posted for storing
    as soon as the engine reports its blocks (a store job on the worker thread while the
    engine computes the next chunk); `finish` posts the rest, and `PrefillDone` goes out
    once every job has made its chunks visible in Redis."""

    needs_lease = False  # it writes the shared store, never a decode node's blocks

    def __init__(self, *args, chunk_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunk_size = chunk_size
        self._first: dict[TransferKey, int] = {}  # the block the engine reports from
        self._blocks: dict[TransferKey, list[int]] = {}  # source blocks seen so far
        self._stored: dict[TransferKey, int] = {}  # prompt tokens posted for storing
        self.early_stores = 0  # store jobs posted before the prompt finished (pipelined)

    def _on_order(self, ident: bytes, order: m.PrefillOrder, at: float) -> list[PrefillEvent]:
        events = super()._on_order(ident, order, at)
        if not events:
            return events
        key = (order.request_id, order.attempt)
        bs = self._data.layout.block_size
        first = order.first_block * bs // self.chunk_size * self.chunk_size // bs
        self._first[key], self._blocks[key] = first, []
        self._stored[key] = first * bs
        return [NewOrder(msgspec.structs.replace(order, first_block=first))]

    def send_blocks(self, key: TransferKey, src_block_ids: list[int], first_index: int) -> None:
        s = self._sends.get(key)
        if s is None or s.state is not SendState.COMPUTING:
            return
        if self.clock() > s.deadline:
            return self._end(key, s, "the order expired")
        self._blocks[key] += src_block_ids
        o, bs = s.order, self._data.layout.block_size
        ready = (self._first[key] + len(self._blocks[key])) * bs
        whole = min(ready, len(o.prompt_token_ids) - 1) // self.chunk_size * self.chunk_size
        if whole > self._stored[key] and self._store(key, s, whole):  # the last: at finish
            self.early_stores += 1

    def _store(self, key: TransferKey, s: _Send, end: int) -> bool:
        """Post a store job for prompt tokens [stored, end)."""
        o, bs, first = s.order, self._data.layout.block_size, self._first[key]
        slots = _slots(o, self._blocks[key], first, bs, end)
        try:
            handle = self._data.store(
                o.prompt_token_ids[:end], slots, self._stored[key], s.deadline
            )
        except RuntimeError as e:
            self._end(key, s, f"cannot store the KV: {e}")
            return False
        s.handles.append(handle)
        self._stored[key] = end
        return True

    def finish(self, key, src_block_ids, first_index, *args, **kwargs) -> None:
        if key in self._blocks:
            self._blocks[key] += src_block_ids
            super().finish(key, self._blocks[key], self._first[key], *args, **kwargs)

    @staticmethod
    def _map(s: _Send, src: list[int], first_index: int) -> tuple[list[int], list[int]]:
        """The blocks of the ordered range (what `PrefillDone.num_blocks` counts); the
        store job itself takes every block from the chunk boundary (`_blocks`)."""
        return src[s.order.first_block - first_index :], []

    def _post(self, key, s: _Send, src: list[int], dst: list[int], notif: bytes | None) -> bool:
        return self._store(key, s, len(s.order.prompt_token_ids))  # the rest of the prompt

    def _sent(self, key: TransferKey, s: _Send) -> list[PrefillEvent]:
        self.control.reply(s.ident, s.final[2])  # every chunk is visible: tell decode
        return super()._sent(key, s)

    def _close(self, key: TransferKey, s: _Send, reason: str) -> list[PrefillEvent]:
        if any(self._data.poll(h) is TransferState.PENDING for h in s.handles):
            return []  # the store job still reads the blocks; it ends by its deadline
        return super()._close(key, s, reason)

    def _drop(self, key: TransferKey, s: _Send) -> None:
        self._forget(key)
        super()._drop(key, s)

    def reject(self, order: m.PrefillOrder, reason: str) -> None:
        self._forget((order.request_id, order.attempt))
        super().reject(order, reason)

    def _forget(self, key: TransferKey) -> None:
        for table in (self._first, self._blocks, self._stored):
            table.pop(key, None)


def lmcache_connector(
    *,
    node_id: str,
    role: str,
    lmcache: LMCacheSettings | None = None,
    control_address: str | None = None,
    abort_grace_s: float = 2.0,
    peer_timeout_s: float = 30.0,
    engine_stall_s: float = 30.0,
    heartbeat_s: float = 1.0,
    cluster_secret: bytes | None = None,
) -> LMCacheDecodeSide | LMCachePrefillSide:
    """The decode or prefill side of the LMCache connector for one node (`lmcache`: the
    store both nodes share; required)."""
    if lmcache is None:
        raise ValueError("the lmcache connector needs its store settings (kv_store.remote_url)")
    data = _data_factory(node_id, lmcache)
    auth = FrameAuth(cluster_secret)
    if role == "decode":
        return LMCacheDecodeSide(
            lambda hello: DecodeControl(
                hello,
                heartbeat_s=heartbeat_s,
                peer_timeout_s=peer_timeout_s,
                stall_s=engine_stall_s,
                auth=auth,
            ),
            data,
            abort_grace_s=abort_grace_s,
        )
    if role == "prefill":
        if not control_address:
            raise ValueError("a prefill node needs a control address (kv control)")
        return LMCachePrefillSide(
            PrefillControl(control_address, auth=auth),
            data,
            grace_s=abort_grace_s / 2,
            chunk_size=lmcache.chunk_size,
        )
    raise ValueError(f"LMCache connector role must be 'prefill' or 'decode', got {role!r}")

"""LMCache as a library: our paged KV cache <-> LMCache's token chunks (local CPU + Redis).

LMCache keys KV by token chunks (`chunk_size` tokens, each key chained from the previous
one's) and keeps them in tiers: a local CPU cache and, with `remote_url`, a Redis server
any node can read. A chunk's tensor is laid out `[2, num_layers, tokens, heads * head_dim]`;
`PagedKVAdapter` copies between that and our paged cache

    kv_cache  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

(layer-major, or a block-major view: `pdserve.kv_transfer.kv_slots.SlotRows` copies slot runs in
either layout, and the chunks are the same bytes) through a slot mapping (slot =
block_id * block_size + offset, one per token; -1 means "leave this token alone"). It
works for CPU and CUDA caches alike (chunk tensors on the CPU).

`LMCacheKVStore` wraps one LMCache engine: `store`, `retrieve`, `lookup`, `close`. Every
call blocks (Redis round trips), so callers run them off the engine loop
(`pdserve.kv_transfer.prefix_store`). Chunk keys hash the token ids with keyed-free blake2b
(not Python's `hash`, whose collisions are easy to construct), under a namespace that
names the model, dtype and KV shape. Every call takes the request's cache salt: a salted
request's chunk hashes are keyed by it, so only requests with the same salt find its
chunks. LMCache's usage telemetry is switched off before it is imported, and `close` is
bounded: LMCache's own close can hang with a Redis backend. Chunks that only Redis holds
are retrieved by `RedisChunkReader` (same keys and bytes, one pipelined round trip)
rather than LMCache's slower Redis read path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

import torch

from pdserve.common.redis_auth import redact
from pdserve.kv_transfer.kv_layout import KVLayout
from pdserve.kv_transfer.kv_slots import SlotRows
from pdserve.kv_transfer.store_sums import StoreChecksums

logger = logging.getLogger(__name__)


def _quiet_lmcache() -> None:
    """Telemetry off, no banner, LMCache's per-call INFO lines off (set before import)."""
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    os.environ["DO_NOT_TRACK"] = "1"
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # our own code logs failures


def _chunk_hash(args, salt: str = "") -> bytes:
    """LMCache's chunk hash over (prefix hash, token ids, extra keys), keyed by the
    request's cache salt when it has one: blake2b, 8 bytes."""
    prefix, tokens, _extra = args
    h = hashlib.blake2b(digest_size=8)
    h.update(int(prefix).to_bytes(8, "little", signed=int(prefix) < 0))
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    if salt:  # no salt: the shared, unsalted keys (unchanged)
        h.update(b"salt\x00" + salt.encode())
    return h.digest()


def _adapter_class():
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class PagedKVAdapter(GPUConnectorInterface):
        """LMCache's view of our paged cache (its 'GPU connector'; CPU or CUDA)."""

        def __init__(self, kv_cache: torch.Tensor):
            self.rows = SlotRows(kv_cache)  # either layout (kv_transfer/kv_slots.py)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.rows.layers, num_tokens, self.rows.hidden])

        def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
            dst = memory_obj.tensor.transpose(0, 1)  # [layers, 2, T, hidden]
            self.rows.read(dst, kwargs["slot_mapping"][start:end])

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
            src = memory_obj.tensor.transpose(0, 1)  # [layers, 2, T, hidden]
            self.rows.write(kwargs["slot_mapping"][start:end], src)

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
            for obj, start, end in zip(memory_objs, starts, ends):
                self.from_gpu(obj, start, end, **kwargs)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
            for obj, start, end in zip(memory_objs, starts, ends):
                self.to_gpu(obj, start, end, **kwargs)

    return PagedKVAdapter


class LMCacheKVStore:
    """One LMCache engine over one paged KV cache. Not thread-safe: call from one thread."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        *,
        namespace: str,
        chunk_size: int = 256,
        local_cpu_bytes: int = 1 << 30,
        remote_url: str | None = None,
        fast_retrieve: bool = True,
        checksums: bool = False,
    ):
        """`fast_retrieve`: read chunks that only Redis holds with `RedisChunkReader`
        (LMCache's layout, one pipelined round trip) instead of LMCache's Redis backend.
        `checksums`: keep each chunk's block checksums beside it and verify them on load
        (kv_transfer/store_sums.py)."""
        _quiet_lmcache()
        from lmcache.v1.cache_engine import LMCacheEngine
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.token_database import ChunkedTokenDatabase

        layout = KVLayout.from_tensor(kv_cache)
        self.chunk_size = chunk_size
        self.remote = remote_url is not None
        self.block_size = layout.block_size
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=chunk_size,
            local_cpu=True,
            max_local_cpu_size=local_cpu_bytes / 2**30,
            remote_url=remote_url,
            remote_serde="naive",
            save_unfull_chunk=True,
        )
        # The key's model name carries everything a chunk's bytes depend on.
        model_name = (
            f"{namespace}|{layout.dtype}|L{layout.num_layers}"
            f"H{layout.num_kv_heads}D{layout.head_dim}"
        )
        metadata = LMCacheMetadata(
            model_name=model_name,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=kv_cache.dtype,
            kv_shape=(layout.num_layers, 2, chunk_size, layout.num_kv_heads, layout.head_dim),
            chunk_size=chunk_size,
        )
        db = ChunkedTokenDatabase(config, metadata)
        self._salt = ""  # the cache salt of the call running (one thread calls this store)
        db.hash_func = lambda args: _chunk_hash(args, self._salt)
        self._engine = LMCacheEngine(config, metadata, db, _adapter_class()(kv_cache), None, None)
        self._engine.post_init()
        self._kv_cache = kv_cache
        self._reader = None  # chunks only in Redis are read directly (lmcache_redis_reader)
        if remote_url is not None and fast_retrieve:
            from pdserve.kv_transfer.lmcache_redis_reader import RedisChunkReader

            self._reader = RedisChunkReader(remote_url, SlotRows(kv_cache))
        self._sums = StoreChecksums(kv_cache, self.block_size, remote_url) if checksums else None
        self._closed = False
        logger.info(
            "LMCache store %s: chunk %d tokens, local CPU %.2f GiB, remote %s",
            model_name,
            chunk_size,
            local_cpu_bytes / 2**30,
            redact(remote_url) or "none",
        )

    # -- operations (blocking) -------------------------------------------------------------
    def store(
        self, token_ids: list[int], slots: list[int], skip_tokens: int = 0, salt: str = ""
    ) -> int:
        """Store the KV of `token_ids` (slot i holds token i) from the chunk holding token
        `skip_tokens` on, under keys of cache salt `salt`; returns the number of tokens
        handed to LMCache."""
        self._salt = salt
        tokens, slot_t, mask = self._args(token_ids, slots, skip_tokens)
        if mask is not None and not bool(mask.any()):
            return 0
        self._engine.store(tokens, mask=mask, kvcaches=self._kv_cache, slot_mapping=slot_t)
        if self._sums is not None:
            self._sums.save(self._chunks(tokens, mask), slots)
        return int(mask.sum()) if mask is not None else len(token_ids)

    def wait_visible(self, token_ids: list[int], deadline: float, salt: str = "") -> bool:
        """Poll until every chunk of `token_ids` is in the remote tier (or the deadline)."""
        if not self.remote:
            return True
        self._salt = salt
        delay = 0.0005
        while True:
            n = self._engine.lookup(token_ids, search_range=["RemoteBackend"])
            if n >= len(token_ids):
                return True
            if time.monotonic() + delay > deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def retrieve(
        self, token_ids: list[int], slots: list[int], skip_tokens: int = 0, salt: str = ""
    ) -> int:
        """Load chunks stored under cache salt `salt` into `slots`, leaving tokens
        [0, skip_tokens) untouched.

        Returns the length of the token prefix now present in the cache: `skip_tokens`
        plus whatever leading tokens LMCache filled after it (0 filled: `skip_tokens`).
        """
        tokens, slot_t, mask = self._args(token_ids, slots, skip_tokens)
        if skip_tokens:
            slot_t[:skip_tokens] = -1  # present locally: never overwrite shared blocks
        self._salt = salt
        chunks = self._chunks(tokens, mask)
        if self._reader is not None and (
            self.lookup(token_ids, local_only=True, salt=salt) < len(token_ids)
        ):
            end = self._reader.read(iter(chunks), slot_t)
        else:
            filled = self._engine.retrieve(
                tokens, mask=mask, kvcaches=self._kv_cache, slot_mapping=slot_t
            )
            start = skip_tokens - skip_tokens % self.chunk_size
            misses = (~filled[start:]).nonzero()
            end = start + (int(misses[0]) if misses.numel() else len(token_ids) - start)
        if self._sums is not None and end > skip_tokens:
            end = self._sums.verified(chunks, slots, skip_tokens, end)
        return max(end, skip_tokens)

    @property
    def checksum_mismatches(self) -> int:
        """Loads cut short because a block failed its checksum."""
        return self._sums.mismatches if self._sums is not None else 0

    def _chunks(self, tokens: torch.Tensor, mask) -> list[tuple[int, int, str]]:
        """(start, end, key) of each chunk LMCache stores or loads for `tokens`."""
        db = self._engine.token_database
        return [(s, e, k.to_string()) for s, e, k in db.process_tokens(tokens, mask=mask)]

    def lookup(
        self,
        token_ids: list[int],
        remote_only: bool = False,
        local_only: bool = False,
        salt: str = "",
    ) -> int:
        """Leading tokens of `token_ids` the store holds under cache salt `salt` (whole
        chunks, plus a last partial)."""
        self._salt = salt
        rng = ["RemoteBackend"] if remote_only else ["LocalCPUBackend"] if local_only else None
        return int(self._engine.lookup(token_ids, search_range=rng))

    def _args(self, token_ids: list[int], slots: list[int], skip_tokens: int):
        if len(slots) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but {len(slots)} slots")
        tokens = torch.tensor(token_ids, dtype=torch.long)
        slot_t = torch.tensor(slots, dtype=torch.long)
        skip = skip_tokens - skip_tokens % self.chunk_size  # masks skip whole chunks
        mask = None
        if skip:
            mask = torch.ones(len(token_ids), dtype=torch.bool)
            mask[:skip] = False
        return tokens, slot_t, mask

    # -- lifetime --------------------------------------------------------------------------
    def close(self, timeout_s: float = 1.0) -> bool:
        """Close LMCache within about 2 x `timeout_s`; True if it closed cleanly.

        LMCache 0.5.6's Redis backend closes with a coroutine on LMCache's storage event
        loop that waits, synchronously, for work on that same loop: it never returns, and
        that loop's (non-daemon) thread would keep the process alive. So the loop is stopped
        first (uploads still queued are dropped), then LMCache's close runs on a daemon
        thread for at most `timeout_s` (the Redis backend's part of it never finishes).
        """
        if self._closed:
            return True
        self._closed = True
        if self._reader is not None:
            self._reader.close()
        if self._sums is not None:
            self._sums.close()
        sm = self._engine.storage_manager
        if sm is not None:
            sm.loop.call_soon_threadsafe(sm.loop.stop)
            sm.thread.join(timeout_s)
        t = threading.Thread(target=self._engine.close, name="lmcache-close", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            logger.info("LMCache close abandoned after %.1f s (its Redis backend hangs)", timeout_s)
        return not t.is_alive()

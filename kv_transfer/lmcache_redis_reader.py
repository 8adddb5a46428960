"""Read LMCache's chunks straight out of Redis into our paged cache (the fast retrieve path).

LMCache 0.5.6's Redis backend reads a chunk as two GETs on its asyncio loop, each through
a priority-queue executor and a semaphore, copies the bytes into a newly allocated memory
object, writes that back into the local CPU tier, and only then copies it into the paged
cache: a retrieve took several times as long as a plain pipelined redis-py GET of the same
bytes (docs/benchmarks-history.md, "KV store"). This reader keeps LMCache's keys and byte
layout (written by LMCache's own store path, `remote_serde="naive"`: per chunk `<key>metadata` and
`<key>kv_bytes`, the tensor `[2, layers, tokens, hidden]` in the cache's dtype) and does
one pipelined round trip for every chunk's metadata and bytes, then one copy per run of
consecutive slots (per block on a block-major cache) from a zero-copy view of the received bytes.

A chunk whose metadata does not describe exactly that tensor (another LMCache version or
layout) counts as missing, as does a chunk Redis lost: the retrieve ends at the first
missing chunk and reports how far it got, like LMCache's own.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable

import torch

from pdserve.kv_transfer.kv_slots import SlotRows

logger = logging.getLogger(__name__)


class RedisChunkReader:
    def __init__(self, url: str, rows: SlotRows, socket_timeout_s: float = 10.0):
        """`rows`: the paged cache's slot rows (either layout)."""
        import redis

        # Chunks are MBs: read the socket 1 MiB at a time (default 64 KiB: hundreds of
        # recv + parser feeds per chunk).
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            socket_read_size=1 << 20,
        )
        self.rows = rows
        self.layers, self.hidden = rows.layers, rows.hidden
        self.token_bytes = 2 * self.layers * self.hidden * rows.dtype.itemsize

    def read(self, chunks: Iterable[tuple[int, int, str]], slots: torch.Tensor) -> int:
        """Copy chunks `(start, end, key)` (in prompt order) into `slots` (-1: left alone).
        Returns the end of the last chunk of the unbroken run of present chunks (the first
        start if none)."""
        from lmcache.v1.protocol import RemoteMetadata

        chunks = list(chunks)
        if not chunks:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for _, _, key in chunks:
            pipe.get(key + "metadata")
            pipe.get(key + "kv_bytes")
        got = pipe.execute()
        present = chunks[0][0]
        for i, (start, end, key) in enumerate(chunks):
            meta, raw = got[2 * i], got[2 * i + 1]
            n = end - start
            if meta is None or raw is None:
                break
            md = RemoteMetadata.deserialize(memoryview(meta))
            want = torch.Size([2, self.layers, n, self.hidden])
            if (
                md.length != n * self.token_bytes
                or len(raw) < md.length
                or list(md.shapes) != [want]
                or list(md.dtypes) != [self.rows.dtype]
            ):
                logger.warning("LMCache chunk %s has an unexpected layout; treated as missing", key)
                break
            with warnings.catch_warnings():  # read-only bytes: we only read them
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(memoryview(raw)[: md.length], dtype=self.rows.dtype)
            src = src.view(2, self.layers, n, self.hidden).transpose(0, 1)
            self.rows.write(slots[start:end], src)
            present = end
        return present

    def close(self) -> None:
        self._client.close()

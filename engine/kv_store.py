"""The hooks through which the engine reuses prompt KV from a shared store (prefix store).

A node with a store (e.g. LMCache over Redis, `pdserve.kv_transfer.prefix_store`) does two
things, both off the engine loop:

* Load: when the scheduler first admits a prompt whose uncached part is at least a
  block, it gives the request blocks for the whole prompt and calls `start_load` with
  the slot of every prompt token and the length already present locally. The request
  waits (status WAITING_FOR_STORE) until `poll` yields `LoadDone(num_tokens)`: tokens
  [0, num_tokens) are now in its blocks. The scheduler caches the full blocks among them
  in the prefix cache and re-queues the request, which then finds them as a local prefix
  hit and computes only the rest (or orders it from a prefill node).
* Salt: a request with a `cache_salt` loads and saves under keys keyed by it, so its
  chunks are found only by requests with the same salt (pdserve/common/block_hash.py).
* Save: when a prompt's last chunk has been computed, the core pins the prompt's blocks
  (an extra reference under a pin key) and calls `start_save`; `SaveDone` follows when
  the store holds the chunks (visible to other nodes), and the core releases the pin.

Failures never fail a request: a load that fails or misses its deadline yields
`LoadDone` with what was already present (the request computes the rest locally), and
the store logs it and counts it. A load that missed its deadline may still be writing:
`LoadDone(late=True)` arrives first and `LoadSettled` later; the scheduler keeps the
request's old blocks (under a park key) out of circulation until then.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import torch


class LoadDone(msgspec.Struct, frozen=True):
    request_id: str
    num_tokens: int  # prompt prefix present in the request's blocks
    late: bool = False  # deadline passed: the load may still write; LoadSettled follows
    failed: bool = False  # the store failed or was unavailable (not merely missing the prefix)


class LoadSettled(msgspec.Struct, frozen=True):
    request_id: str  # a late load has ended: its parked blocks may be freed


class SaveDone(msgspec.Struct, frozen=True):
    request_id: str
    ok: bool


StoreEvent = LoadDone | LoadSettled | SaveDone


class KVStore(Protocol):
    def attach(self, kv_cache: torch.Tensor) -> None:
        """Called once the engine exists, with its paged KV cache tensor."""
        ...

    def start_load(
        self, request_id: str, token_ids: list[int], slots: list[int], present: int, salt: str = ""
    ) -> None:
        """Fill slots of tokens [present, ...) with KV stored under cache salt `salt`
        ("": the shared, unsalted keys); `LoadDone` follows."""
        ...

    def abandon_load(self, request_id: str) -> None:
        """The request ended mid-load: `LoadSettled` follows once nothing writes its slots."""
        ...

    def start_save(
        self, request_id: str, token_ids: list[int], slots: list[int], stored: int, salt: str = ""
    ) -> None:
        """Store the prompt's KV under keys of cache salt `salt`; `SaveDone` follows. Tokens [0, stored) came from a store
        (perhaps another backend's): a backend skips only the part of them it holds."""
        ...

    def poll(self) -> list[StoreEvent]: ...

    def has_pending(self) -> bool: ...

    def stats(self) -> dict[str, int]:
        """Counters for EngineStats (names of its kv_store_* fields)."""
        ...

    def shutdown(self) -> None:
        """Bounded: returns within a few seconds even if the store hangs."""
        ...

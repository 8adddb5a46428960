"""MultiConnector: a node's KV backends composed in one configured order.

A node lists its backends (`kv_backends`, engine/config.py), each with roles, the way
vLLM's MultiConnector composes connectors ("load from the first that has it, save to
all"):

  * `transfer`: moves a PD request's KV between its prefill and decode node (NIXL
    WRITEs, or LMCache through Redis). At most one; it is the node's
    `DecodeConnector` / `PrefillConnector` (kv_transfer/base.py), driven by the PD role.
  * `load`: a prefix store asked, in list order, for a new prompt's stored prefix.
  * `save`: a prefix store that receives every prompt this node computes.

Where a prompt's KV comes from (decode or colocated node), first source first: the
node's own prefix cache; then the `load` backends in list order, the first that brings
any token serving the load (vLLM's rule); then the `transfer` backend for whatever is
still missing (the prefill node computes and pushes only that); else local compute.
A backend that fails (its Redis down, LMCache raising) is logged, counted
(`kv_store_load_failures`, and `kv_store_fallbacks` when the load moves on), skipped for
its `retry_after_s`, and the load goes to the next backend. One past its deadline may
still be writing the request's blocks, so no other backend may: the load ends there with
what was present (the request computes the rest) and the blocks stay parked until it
settles. A failure costs at most one backend's deadline, never the request.
Where a computed prompt's KV goes (any node): to the decode node over `transfer` (a
prefill node, by the PD role), and to every `save` backend; the prompt's blocks stay
pinned until every save backend has answered, and the save counts as visible (the
cluster's KV index lists it) if any of them succeeded. Each save backend skips only
the part of a loaded prefix it holds itself (kv_transfer/prefix_store.py).

The class is the engine's `KVStore` (engine/kv_store.py) over the load/save backends,
each a `PrefixStore` with its own worker thread; it owns the transfer connector and
hands it to the PD role (node/roles.py). Everything here runs on the engine thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pdserve.engine.kv_store import KVStore, LoadDone, LoadSettled, SaveDone, StoreEvent
from pdserve.kv_transfer.base import DecodeConnector, PrefillConnector

logger = logging.getLogger(__name__)


@dataclass
class StoreBackend:
    """One prefix-store backend and the roles it plays."""

    name: str
    store: KVStore
    load: bool
    save: bool
    served_tokens: int = 0  # prompt tokens this backend's loads brought
    fallbacks: int = 0  # loads passed on to the next backend after this one failed


@dataclass
class _Load:
    token_ids: list[int]
    slots: list[int]
    present: int
    order: list[int]  # indices of load backends, in order; order[0] is running
    salt: str = ""  # the request's cache salt
    abandoned: bool = False


@dataclass
class _Save:
    waiting: set[int] = field(default_factory=set)  # backend indices yet to answer
    ok: bool = False


class MultiConnector:
    def __init__(
        self,
        stores: list[StoreBackend],
        transfer: DecodeConnector | PrefillConnector | None = None,
        transfer_name: str | None = None,
    ):
        self.stores = stores
        self.transfer = transfer
        self.transfer_name = transfer_name
        self._loads: dict[str, _Load] = {}
        self._saves: dict[str, _Save] = {}
        self._ready: list[StoreEvent] = []
        self.fallbacks = 0

    @property
    def has_store(self) -> bool:
        return bool(self.stores)

    def describe(self) -> str:
        parts = [f"{self.transfer_name}[transfer]"] if self.transfer is not None else []
        for b in self.stores:
            roles = ",".join(r for r, on in (("load", b.load), ("save", b.save)) if on)
            parts.append(f"{b.name}[{roles}]")
        return " -> ".join(parts) or "none"

    # -- KVStore hooks (engine thread) -----------------------------------------------------
    def attach(self, kv_cache: torch.Tensor) -> None:
        for b in self.stores:
            b.store.attach(kv_cache)

    def start_load(
        self, request_id: str, token_ids: list[int], slots: list[int], present: int, salt: str = ""
    ) -> None:
        order = [i for i, b in enumerate(self.stores) if b.load]
        if not order:
            self._ready.append(LoadDone(request_id, present))
            return
        self._loads[request_id] = _Load(token_ids, slots, present, order, salt)
        self.stores[order[0]].store.start_load(request_id, token_ids, slots, present, salt)

    @property
    def can_load(self) -> bool:
        """Whether any backend loads (else the scheduler never waits for a store load)."""
        return any(b.load for b in self.stores)

    def abandon_load(self, request_id: str) -> None:
        """The request ended mid-load: the running backend's `LoadSettled` follows, or
        ours at once when no backend runs it (its `LoadDone` already queued)."""
        load = self._loads.pop(request_id, None)
        if load is not None:
            self.stores[load.order[0]].store.abandon_load(request_id)
        else:
            self._ready.append(LoadSettled(request_id))

    def start_save(
        self, request_id: str, token_ids: list[int], slots: list[int], stored: int, salt: str = ""
    ) -> None:
        targets = {i for i, b in enumerate(self.stores) if b.save}
        if not targets:
            self._ready.append(SaveDone(request_id, False))
            return
        self._saves[request_id] = _Save(set(targets))
        for i in sorted(targets):
            self.stores[i].store.start_save(request_id, token_ids, slots, stored, salt)

    def poll(self) -> list[StoreEvent]:
        events, self._ready = self._ready, []
        for i, b in enumerate(self.stores):
            for ev in b.store.poll():
                out = self._on_event(i, ev)
                if out is not None:
                    events.append(out)
        return events

    def _on_event(self, i: int, ev: StoreEvent) -> StoreEvent | None:
        rid = ev.request_id
        if isinstance(ev, SaveDone):
            save = self._saves.get(rid)
            if save is None:
                return None
            save.waiting.discard(i)
            save.ok |= ev.ok
            if save.waiting:
                return None  # the pin holds until every save backend has answered
            del self._saves[rid]
            return SaveDone(rid, save.ok)
        if isinstance(ev, LoadSettled):
            return ev  # a late or abandoned load of this backend ended: unpark
        load = self._loads.get(rid)
        if load is None or load.order[0] != i:
            return None
        b = self.stores[i]
        if ev.num_tokens > load.present:
            b.served_tokens += ev.num_tokens - load.present
        if ev.late or ev.num_tokens > load.present or len(load.order) == 1:
            del self._loads[rid]  # served, or still writing (no other backend may write)
            return ev
        load.order.pop(0)
        nxt = self.stores[load.order[0]]
        if ev.failed:
            b.fallbacks += 1
            self.fallbacks += 1
            logger.warning(
                "request %s: KV load backend %s failed; trying %s", rid, b.name, nxt.name
            )
        nxt.store.start_load(rid, load.token_ids, load.slots, load.present, load.salt)
        return None

    def has_pending(self) -> bool:
        return bool(self._ready) or any(b.store.has_pending() for b in self.stores)

    def stats(self) -> dict[str, int]:
        """Each counter summed over the backends, plus `kv_store_fallbacks`."""
        total: dict[str, int] = {"kv_store_fallbacks": self.fallbacks}
        for b in self.stores:
            for k, v in b.store.stats().items():
                total[k] = total.get(k, 0) + v
        return total

    def backend_stats(self) -> dict[str, dict[str, int]]:
        """Per backend: its store counters, the tokens its loads served, its fallbacks."""
        return {
            b.name: {**b.store.stats(), "served_tokens": b.served_tokens, "fallbacks": b.fallbacks}
            for b in self.stores
        }

    def shutdown(self) -> None:
        """Bounded: each backend's shutdown is (a few seconds at most each)."""
        for b in self.stores:
            try:
                b.store.shutdown()
            except Exception:
                logger.exception("KV backend %s: shutdown failed", b.name)

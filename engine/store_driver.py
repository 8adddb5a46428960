"""StoreDriver: the engine loop's side of a shared prefix store (engine/kv_store.py).

The engine core owns one when it has a `KVStore`; the driver turns scheduler decisions
into store jobs and store events back into scheduler and KV-cache changes, all on the
engine thread:
  * `start_loads`: prompts the scheduler admitted for a load get their slots filled;
  * `apply_events`: `LoadDone` re-queues the request with what arrived; `LoadSettled`
    frees the blocks a late load kept parked; `SaveDone` unpins a saved prompt's blocks
    and, once the save is visible, lists its whole-chunk blocks for the cluster's KV index
    (`BlockPool.note_store_saved`);
  * `save_prompts`: a prompt whose last chunk ran this step is pinned and saved; so is
    a running request's prefix each time its generated tokens fill another whole chunk
    (one such save in flight per request), so that a continuation of it on another node
    (router/migration.py) loads prompt and generated tokens from the store;
  * `park_load`: a request ended mid-load keeps its blocks parked until `LoadSettled`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.kv_store import KVStore, LoadDone, LoadSettled, SaveDone

if TYPE_CHECKING:
    from pdserve.engine.kv_cache_manager import KVCacheManager
    from pdserve.engine.scheduler import Scheduler, SchedulerOutput


class StoreDriver:
    def __init__(
        self,
        store: KVStore,
        kv: KVCacheManager,
        scheduler: Scheduler,
        block_size: int,
        chunk_size: int,
    ):
        self.store = store
        self.kv = kv
        self.scheduler = scheduler
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.parked: dict[str, list[str]] = {}  # request id -> park keys of late loads
        self._jobs = 0  # numbers the owner keys of store jobs
        self._saving: dict[str, list[bytes]] = {}  # save key -> its whole chunks' hashes
        self._generated: dict[str, str] = {}  # save key -> request id: a generated save

    def has_pending(self) -> bool:
        return self.store.has_pending() or bool(self.parked)

    def _key(self, rid: str, what: str) -> str:
        self._jobs += 1
        return f"{rid}#store-{what}-{self._jobs}"

    def _slots(self, block_ids: list[int], num_tokens: int) -> list[int]:
        bs = self.block_size
        return [b * bs + i for b in block_ids for i in range(bs)][:num_tokens]

    def park_load(self, rid: str) -> str:
        key = self._key(rid, "load")
        self.parked.setdefault(rid, []).append(key)
        return key

    def abandon_load(self, rid: str) -> None:
        """The request ended while its load ran: its blocks move to a park key (so the
        scheduler's `finish` frees none) and stay there until the load's `LoadSettled`."""
        self.kv.park(rid, self.park_load(rid))
        self.store.abandon_load(rid)

    def apply_events(self) -> None:
        for ev in self.store.poll():
            rid = ev.request_id
            if isinstance(ev, SaveDone):
                self.kv.release(rid)  # the save job's pin key
                self._generated.pop(rid, None)
                hashes = self._saving.pop(rid, [])
                if ev.ok:
                    self.kv.pool.note_store_saved(hashes)
            elif isinstance(ev, LoadSettled):
                keys = self.parked.get(rid)
                if keys:
                    self.kv.release(keys.pop(0))
                    if not keys:
                        del self.parked[rid]
            elif isinstance(ev, LoadDone) and rid in self.scheduler.store_loading:
                park = self.park_load(rid) if ev.late else None
                self.scheduler.store_load_done(rid, ev.num_tokens, park)

    def start_loads(self, sched: SchedulerOutput) -> None:
        for req in sched.store_loads:
            slots = self._slots(self.kv.get_block_ids(req.request_id), req.num_tokens)
            salt = req.sampling_params.cache_salt  # its keys are keyed by it, like its blocks'
            self.store.start_load(
                req.request_id, req.all_token_ids, slots, req.num_computed_tokens, salt
            )

    def save_prompts(self, sched: SchedulerOutput) -> None:
        """Save each prompt whose last chunk ran this step, and each running request's
        prefix whose generated tokens filled another chunk (blocks pinned meanwhile)."""
        busy = set(self._generated.values())
        for s in sched.scheduled:
            req, n = s.request, s.request.num_prompt_tokens
            done = req.num_computed_tokens + s.num_new_tokens  # tokens whose KV is written
            if not req.store_saved and req.num_computed_tokens < n <= done:
                req.store_saved = True
                # Saved even when a load brought it whole: each save backend skips what
                # it holds itself (the one that served it answers at once).
                self._save(req, req.prompt_token_ids, req.store_tokens)
                continue
            whole = done - done % self.chunk_size
            if whole <= max(n, req.store_saved_upto) or req.kv_export:
                continue
            if req.request_id not in busy:  # else at a later step, a chunk more
                # the prompt's whole chunks were saved by whoever computed them (here, or
                # the prefill node of a PD request): the backend checks before skipping
                stored = max(req.store_saved_upto, n - n % self.chunk_size)
                key = self._save(req, req.all_token_ids[:whole], stored)
                self._generated[key] = req.request_id

    def _save(self, req, token_ids: list[int], stored: int) -> str:
        """Pin the blocks of `token_ids` (a prefix of the request's) and save them; tokens
        [0, stored) are perhaps held already (the backend skips what it holds)."""
        bs, n = self.block_size, len(token_ids)
        key = self._key(req.request_id, "save")
        ids = self.kv.pin(req.request_id, -(-n // bs), key)
        whole = n - n % self.chunk_size  # a partial chunk's key matches only itself
        self._saving[key] = req.block_hashes[: whole // bs]
        req.store_saved_upto = max(req.store_saved_upto, whole)
        salt = req.sampling_params.cache_salt
        self.store.start_save(key, token_ids, self._slots(ids, n), stored, salt)
        return key

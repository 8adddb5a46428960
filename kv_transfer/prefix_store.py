"""PrefixStore: the engine's `KVStore` hooks (engine/kv_store.py) run on a worker thread.

The engine thread only queues jobs and drains results; the worker thread owns the
backend (`LMCacheKVStore`, built on the worker) and does every blocking call. `attach`
waits for the backend at most `startup_timeout_s`; until it is up, loads are skipped
(the request computes) and saves wait in the queue.

Failure policy (never a failed request, never a hang):
  * a load that raises, or whose backend is unreachable, ends with what was present
    locally; one that misses `load_timeout_s` is reported late and settles later;
  * a save that raises, or is not visible remotely within `save_timeout_s`, is dropped;
  * after any failure the store is skipped for `retry_after_s` (loads and saves return
    at once), so a dead Redis costs one deadline, not one per request.
Every failure is logged with its request id and counted (`kv_store_*_failures`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.kv_store import LoadDone, LoadSettled, SaveDone, StoreEvent

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    kind: str  # "load" | "save"
    request_id: str
    token_ids: list[int]
    slots: list[int]
    present: int  # load: tokens present locally; save: tokens perhaps stored already
    deadline: float
    abandoned: bool = False  # load: the engine stopped waiting (skip it if not started)
    salt: str = ""  # the request's cache salt: its chunks' keys are keyed by it


class PrefixStore:
    def __init__(
        self,
        backend_factory: Callable[[torch.Tensor], object],
        *,
        load_timeout_s: float = 10.0,
        save_timeout_s: float = 30.0,
        retry_after_s: float = 10.0,
        startup_timeout_s: float = 60.0,
        health_check: Callable[[], None] | None = None,
    ):
        """`backend_factory(kv_cache)` builds the backend (store/retrieve/wait_visible/close);
        `health_check()` raises if the remote tier is unreachable (checked before jobs)."""
        self._factory = backend_factory
        self.load_timeout_s = load_timeout_s
        self.save_timeout_s = save_timeout_s
        self.retry_after_s = retry_after_s
        self._health_check = health_check
        self.startup_timeout_s = startup_timeout_s
        self._started = threading.Event()  # the backend was built (or failed to be)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        # (job, its event, error or None), from the worker
        self._results: queue.Queue[tuple[_Job, StoreEvent, str | None]] = queue.Queue()
        self._ready: list[StoreEvent] = []  # events made on the engine thread
        self._loads: dict[str, _Job] = {}  # request id -> pending load
        self._pending = 0  # jobs queued or running (engine-thread count)
        self._down_until = 0.0
        self._thread: threading.Thread | None = None
        self._backend = None
        self.counters = dict.fromkeys(
            (
                "kv_store_loads",
                "kv_store_load_failures",
                "kv_store_saves",
                "kv_store_save_failures",
            ),
            0,
        )

    # -- engine thread ---------------------------------------------------------------------
    def attach(self, kv_cache: torch.Tensor) -> None:
        self._thread = threading.Thread(
            target=self._work, args=(kv_cache,), name="kv-store", daemon=True
        )
        self._thread.start()
        if not self._started.wait(self.startup_timeout_s):
            logger.warning(
                "KV store not up after %g s; loads skipped until it is", self.startup_timeout_s
            )

    def start_load(
        self, request_id: str, token_ids: list[int], slots: list[int], present: int, salt: str = ""
    ) -> None:
        if self._down(request_id, "load") or not self._started.is_set():
            self._ready.append(LoadDone(request_id, present, failed=True))
            return
        deadline = time.monotonic() + self.load_timeout_s
        job = _Job("load", request_id, token_ids, slots, present, deadline, salt=salt)
        self._loads[request_id] = job
        self._submit(job)

    def abandon_load(self, request_id: str) -> None:
        """The request was aborted mid-load: `LoadSettled` follows once the job has ended
        (at once when there is none: the load was answered without one, store down)."""
        job = self._loads.pop(request_id, None)
        if job is not None:
            job.abandoned = True
        else:
            self._ready.append(LoadSettled(request_id))

    def start_save(
        self, request_id: str, token_ids: list[int], slots: list[int], stored: int, salt: str = ""
    ) -> None:
        if self._down(request_id, "save"):
            self._ready.append(SaveDone(request_id, False))
            return
        deadline = time.monotonic() + self.save_timeout_s
        self._submit(_Job("save", request_id, token_ids, slots, stored, deadline, salt=salt))

    def poll(self) -> list[StoreEvent]:
        events, self._ready = self._ready, []
        while True:
            try:
                job, ev, error = self._results.get_nowait()
            except queue.Empty:
                break
            self._pending -= 1
            # A load the engine stopped waiting for (deadline, abort) only settles now;
            # a deadline was counted as its failure already.
            stale = job.kind == "load" and self._loads.get(job.request_id) is not job
            if stale:
                ev = LoadSettled(job.request_id)
            elif job.kind == "load":
                del self._loads[job.request_id]
            if error is not None and not stale:
                self._fail(job.kind, job.request_id, error)
            elif error is None:
                self.counters["kv_store_saves" if job.kind == "save" else "kv_store_loads"] += 1
            events.append(ev)
        now = time.monotonic()
        for rid, job in list(self._loads.items()):
            if now > job.deadline:
                del self._loads[rid]
                job.abandoned = True
                self._fail("load", rid, f"no answer within {self.load_timeout_s:g} s")
                events.append(LoadDone(rid, job.present, late=True))
        return events

    def has_pending(self) -> bool:
        return self._pending > 0 or bool(self._ready)

    def stats(self) -> dict[str, int]:
        sums = getattr(self._backend, "checksum_mismatches", 0)  # an int the worker bumps
        return {**self.counters, "kv_store_checksum_mismatches": sums}

    def shutdown(self, timeout_s: float = 3.0) -> None:
        """Stop the worker and close the backend, within about `timeout_s`."""
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV store worker still busy after %.1f s; not waiting", timeout_s)
        self._thread = None

    def _submit(self, job: _Job) -> None:
        self._pending += 1
        self._jobs.put(job)

    def _down(self, rid: str, what: str) -> bool:
        if time.monotonic() < self._down_until:
            logger.debug("request %s: KV store skipped for %s (recently failed)", rid, what)
            return True
        return False

    def _fail(self, what: str, rid: str, reason: str) -> None:
        self.counters[f"kv_store_{what}_failures"] += 1
        self._down_until = time.monotonic() + self.retry_after_s
        logger.warning(
            "request %s: KV store %s failed (%s); computing locally, store skipped for %g s",
            rid,
            what,
            reason,
            self.retry_after_s,
        )

    # -- worker thread ---------------------------------------------------------------------
    def _work(self, kv_cache: torch.Tensor) -> None:
        try:
            self._backend = self._factory(kv_cache)
        except Exception as e:  # LMCache missing or misconfigured: every job fails fast
            logger.error("KV store unavailable: %r", e)
        self._started.set()
        while (job := self._jobs.get()) is not None:
            try:
                self._results.put((job, self._run(job), None))
            except Exception as e:
                ev = SaveDone(job.request_id, False) if job.kind == "save" else None
                ev = ev or LoadDone(job.request_id, job.present, failed=True)
                self._results.put((job, ev, repr(e)))
        if self._backend is not None:
            self._backend.close()

    def _run(self, job: _Job) -> StoreEvent:
        if job.kind == "load" and job.abandoned:
            return LoadSettled(job.request_id)
        if self._backend is None:
            raise RuntimeError("the KV store backend did not start")
        if self._health_check is not None:
            self._health_check()
        b, salt = self._backend, job.salt
        if job.kind == "save":
            # `present` is what a load brought, perhaps from another backend: skip only
            # the part this one holds, or wait_visible (the chain) never sees the rest.
            skip = job.present
            if skip:
                remote = bool(getattr(b, "remote", False))
                skip = min(skip, b.lookup(job.token_ids[:skip], remote_only=remote, salt=salt))
            if skip >= len(job.token_ids):  # it holds the whole prompt (it served the load)
                return SaveDone(job.request_id, True)
            b.store(job.token_ids, job.slots, skip, salt=salt)
            if not b.wait_visible(job.token_ids, job.deadline, salt=salt):
                raise TimeoutError(f"chunks not visible within {self.save_timeout_s:g} s")
            return SaveDone(job.request_id, True)
        n = b.retrieve(job.token_ids, job.slots, job.present, salt=salt)
        logger.debug("request %s: %d prompt tokens present after load", job.request_id, n)
        return LoadDone(job.request_id, n)


def redis_health_check(url: str) -> Callable[[], None]:
    """A check that raises unless the Redis at `url` answers PING within a second."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0)

    def check() -> None:
        client.ping()

    return check

"""The token-budget scheduler.

Design note: there is no prefill phase or decode phase. Each request has
`num_computed_tokens`, which catches up with `num_tokens` (prompt + output so far). A step
gives every scheduled request some new tokens under one budget
(`max_num_batched_tokens`): running requests first (a decode needs 1 token, an unfinished
chunked prefill needs the rest of its prompt), then waiting requests in arrival order,
whose prompts may be cut into chunks. When the pool cannot hold a running request's next
tokens, the most recently admitted running request is preempted: its blocks are freed and
it goes back to the front of the waiting queue, to be recomputed here (prefix cache
permitting), also when its prompt's KV had come from a prefill node.

PD (decode role): a waiting request with `remote_prefill` set is admitted only when the
pool can hold its whole prompt; it gets blocks for the part its own prefix cache lacks and
waits in `remote_waiting` (status WAITING_FOR_REMOTE_KV) while a prefill node fills them.
`remote_kv_ready` then makes it a running request with its first token, or
`remote_kv_failed` ends it or sends it back to be prefilled here. A short uncached suffix
(`local_prefill_max_tokens`) is prefilled here directly.

KV store (engine/kv_store.py): a new prompt whose uncached part is at least a block first
gets blocks for the whole prompt and waits in `store_loading` while the store fills what
it has; `store_load_done` caches the loaded blocks and re-queues the request at the
front, where it finds them as a local prefix hit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.messages import RequestState
from pdserve.engine.outputs import TokenLogprobs
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sampled


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's known tokens."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    remote_prefills: list[Request] = field(default_factory=list)  # newly waiting for remote KV
    # prefill node: exports ended because the pool ran out (their blocks are held: an
    # in-flight WRITE may still read them); the core hands each hold to the KV role
    dropped_exports: list[tuple[Request, tuple[str, int]]] = field(default_factory=list)
    store_loads: list[Request] = field(default_factory=list)  # newly waiting for the KV store

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_waiting: dict[str, Request] = {}
        self.num_preemptions = 0
        self.store_loads_enabled = False  # set by the engine when it has a KV store
        self.store_loading: dict[str, Request] = {}
        self.store_hit_tokens = 0  # prompt tokens taken from the KV store

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.remote_waiting or self.store_loading)

    def describe(self, compiling: Iterable[Request] = ()) -> list[RequestState]:
        """Every unfinished request and where it is (for `/debug/engine`); `compiling`:
        those not here yet, waiting for their grammar."""
        now = time.monotonic()
        queues = (
            ("compiling_grammar", compiling),
            ("running", self.running),
            ("waiting", self.waiting),
            ("waiting_for_kv", self.remote_waiting.values()),
            ("loading_from_store", self.store_loading.values()),
        )
        return [
            RequestState(
                request_id=r.request_id,
                queue=queue,
                status=r.status.name.lower(),
                prompt_tokens=r.num_prompt_tokens,
                computed_tokens=r.num_computed_tokens,
                output_tokens=len(r.output_token_ids),
                max_tokens=r.sampling_params.max_tokens,
                age_s=round(now - r.arrival_time, 3),
                remote_prefill=r.remote_prefill,
            )
            for queue, requests in queues
            for r in requests
        ]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        # 1. Running requests, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()  # newest admitted
                self._preempt(victim, out)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new))
                scheduled_ids.add(req.request_id)
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: nothing after it can run either

        # 2. Waiting requests, unless this step had to preempt.
        while self.waiting and not out.preempted and budget > 0:
            busy = len(self.running) + len(self.remote_waiting) + len(self.store_loading)
            if busy >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            if req.wants_prompt_logprobs:  # every prompt position's logits are needed
                computed, num_computed = [], 0
            else:
                computed, num_computed = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_computed
            if self.store_loads_enabled and not req.store_checked and not req.wants_prompt_logprobs:
                req.store_checked = True
                if num_new > self.kv.block_size and self._admit_store_load(
                    req, computed, num_computed
                ):
                    out.store_loads.append(req)
                    continue
            if req.remote_prefill is not None:
                if num_new > self.config.local_prefill_max_tokens:
                    if not self._admit_remote(req, computed, num_computed):
                        break
                    out.remote_prefills.append(req)
                    continue
                req.remote_prefill = None  # short suffix: prefill it here
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            req.num_computed_tokens = num_computed
            if self.kv.allocate_slots(req, num_new, computed) is None:
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return out

    def _admit_remote(self, req: Request, computed, num_computed: int) -> bool:
        """Hold blocks for the whole prompt (none cached until the KV lands)."""
        if not self._park(req, computed, num_computed):
            return False
        req.num_cached_tokens = num_computed
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote_waiting[req.request_id] = req
        return True

    def _admit_store_load(self, req: Request, computed, num_computed: int) -> bool:
        """Hold blocks for the whole prompt while the store fills them (False: no room now,
        the request takes the normal path instead)."""
        if not self._park(req, computed, num_computed):
            return False
        req.status = RequestStatus.WAITING_FOR_STORE
        self.store_loading[req.request_id] = req
        return True

    def _park(self, req: Request, computed, num_computed: int) -> bool:
        """Allocate the rest of the prompt uncached and take `req` off the waiting queue
        (False, request untouched: no room now)."""
        req.num_computed_tokens = num_computed
        if (
            self.kv.allocate_slots(req, req.num_tokens - num_computed, computed, cache=False)
            is None
        ):
            req.num_computed_tokens = 0
            return False
        self.waiting.popleft()
        return True

    def store_load_done(self, request_id: str, num_tokens: int, park_as: str | None) -> Request:
        """The store has filled the prompt's tokens [0, num_tokens): cache their full blocks
        and re-queue the request at the front. `park_as`: the load may still be writing,
        so its blocks move to that owner key (released by the caller) and nothing is cached.
        """
        req = self.store_loading.pop(request_id)
        present = req.num_computed_tokens
        if park_as is not None:
            self.kv.park(request_id, park_as)
        else:
            self.kv.cache_blocks(req, num_tokens)
            self.kv.free(req)
            # Whole blocks only, and the prompt's last token is always computed.
            usable = min(num_tokens, req.num_tokens - 1) // self.kv.block_size
            self.store_hit_tokens += max(0, usable * self.kv.block_size - present)
            req.store_tokens = num_tokens
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        return req

    def remote_kv_ready(
        self,
        request_id: str,
        first_token: int,
        logprob: float | None,
        top: TokenLogprobs | None = None,
    ) -> Request:
        """Every prompt block arrived: cache them, append the first token, start decoding."""
        req = self.remote_waiting.pop(request_id)
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_blocks(req, req.num_tokens)
        if req.grammar is not None:  # the prefill node sampled it under the same grammar
            req.grammar.accept(first_token)
        req.append_output_token(first_token, logprob, top)
        status = req.check_stop(self.max_model_len)
        if status is not None:
            req.status = status
            self.kv.free(req)
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        return req

    def remote_kv_failed(
        self, request_id: str, prefill_locally: bool, reason: str
    ) -> tuple[str, int]:
        """The remote prefill failed or timed out. Its blocks may still receive a late write,
        so they are held (not freed) under the returned key until the caller releases them.
        The request is then prefilled (at the front of the queue; here, unless the caller
        sets `remote_prefill` to another prefill node) or ends with an error.
        """
        req = self.remote_waiting.pop(request_id)
        key = self.kv.hold(req)
        req.num_computed_tokens = 0
        req.remote_prefill = None
        if prefill_locally:
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        else:
            req.status = RequestStatus.FINISHED_ERROR
            req.error = reason
        return key

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        if req.kv_export:  # recomputing into new blocks could race a WRITE of the old ones
            req.status = RequestStatus.FINISHED_ABORTED
            req.error = "the prefill node ran out of KV blocks"
            out.dropped_exports.append((req, self.kv.hold(req)))
            return
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        # Recomputed here, even if its prompt's KV came from a prefill node: an order
        # carries the prompt alone, never the tokens generated since (their KV would not come)
        req.remote_prefill = None
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, Sampled]
    ) -> list[Request]:
        """Advance each scheduled request; append sampled tokens; return newly finished."""
        finished = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if req.request_id not in sampled:
                continue
            req.append_output_token(*sampled[req.request_id])
            status = req.check_stop(self.max_model_len)
            if status is not None:
                self.finish(req, status)
                finished.append(req)
        return finished

    def finish(self, req: Request, status: RequestStatus) -> tuple[str, int] | None:
        """End a request (stop, length, abort, error) and free its blocks.

        Blocks that a transfer may still touch are held instead (a remote prefill still
        writing, an export still reading); the hold key is returned for the caller to release.
        """
        prev, req.status = req.status, status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.remote_waiting.pop(req.request_id, None)
        self.store_loading.pop(req.request_id, None)  # its blocks were parked by the caller
        if prev == RequestStatus.WAITING_FOR_REMOTE_KV or req.kv_export:
            return self.kv.hold(req)
        self.kv.free(req)
        return None

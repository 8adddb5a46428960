"""The token-budget scheduler.

Design note: there is no prefill phase or decode phase. Each request has
`num_computed_tokens`, which catches up with `num_tokens` (prompt + output so far). A step
gives every scheduled request some new tokens under one budget
(`max_num_batched_tokens`): running requests first (a decode needs 1 token, an unfinished
chunked prefill needs the rest of its prompt), then waiting requests in arrival order,
whose prompts may be cut into chunks. When the pool cannot hold a running request's next
tokens, the most recently admitted running request is preempted: its blocks are freed and
it goes back to the front of the waiting queue, to be recomputed (prefix cache permitting).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


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
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

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
                self._preempt(victim)
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
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            computed, num_computed = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_computed
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

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, tuple[int, float | None]]
    ) -> list[Request]:
        """Advance each scheduled request; append sampled tokens; return newly finished."""
        finished = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if req.request_id not in sampled:
                continue
            token, logprob = sampled[req.request_id]
            req.append_output_token(token, logprob)
            status = req.check_stop(self.max_model_len)
            if status is not None:
                self.finish(req, status)
                finished.append(req)
        return finished

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and free its blocks."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

"""PrefillRole: the engine hooks that export prompt KV to decode nodes.

An order `(request_id, attempt)` runs as the engine request `"{request_id}@{attempt}"`,
so two attempts of one request never share an engine request or a hold. When the
request ends (its first token sampled, or early: abort, error, out of blocks) its
blocks move into a hold that this role owns; it releases the hold only when the
connector reports `SendDone`/`SendFailed` (no WRITE reads the blocks any more).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.engine.kv_cache_manager import HoldKey
from pdserve.engine.kv_role import EngineHandle
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kv_transfer.base import (
    NewOrder,
    OrderAborted,
    PrefillConnector,
    SendDone,
    SendFailed,
    TransferKey,
)

logger = logging.getLogger(__name__)

# After a step that posted WRITEs, drive them this long at most before the next step: with
# no NIXL progress thread a pending WRITE (and the done notification it carries) would
# otherwise wait out that whole step. Same-host WRITEs finish in microseconds.
FLUSH_S = 0.05


@dataclass
class _Export:
    key: TransferKey
    first_block: int  # decode holds prompt blocks [0, first_block) already
    next_block: int  # next prompt block to push
    num_blocks: int  # prompt blocks in all
    waited_s: float = 0.0  # the order unread in the control socket (part of the queue)


def engine_request_id(key: TransferKey) -> str:
    return f"{key[0]}@{key[1]}"


class PrefillRole:
    accepts_remote_prefill = False

    def __init__(self, connector: PrefillConnector, flush_s: float = FLUSH_S):
        """`flush_s`: how long to drive posted WRITEs after a step (0: one pass)."""
        self.connector = connector
        self.flush_s = flush_s
        self._exports: dict[str, _Export] = {}  # engine request id -> export progress
        self._keys: dict[str, TransferKey] = {}  # engine request id -> transfer key
        self._held: dict[TransferKey, HoldKey] = {}  # until SendDone/SendFailed
        self.num_orders = 0
        self.bytes_sent = 0

    def attach(self, core: EngineHandle) -> None:
        self.connector.register_kv_cache(core.kv_ranks or core.kv_cache)

    def stats(self) -> dict[str, int]:
        return {"pd_orders": self.num_orders, "kv_bytes_sent": self.bytes_sent}

    def before_step(self, core: EngineHandle) -> list[EngineCoreOutput]:
        for ev in self.connector.poll():
            if isinstance(ev, NewOrder):
                self._start(core, ev)
            elif isinstance(ev, OrderAborted):
                core.end_request(engine_request_id(ev.key), RequestStatus.FINISHED_ABORTED)
            elif isinstance(ev, (SendDone, SendFailed)):
                if isinstance(ev, SendDone):
                    self.bytes_sent += ev.bytes
                eid = engine_request_id(ev.key)
                core.end_request(eid, RequestStatus.FINISHED_ABORTED)  # if still computing
                self._keys.pop(eid, None)
                hold = self._held.pop(ev.key, None)
                if hold is not None:
                    core.kv.release_hold(hold)
        return []  # prefill-order requests produce nothing for this node's own clients

    def _start(self, core: EngineHandle, ev: NewOrder) -> None:
        order, key = ev.order, ev.key
        eid = engine_request_id(key)
        try:
            req = core.add_request(eid, order.prompt_token_ids, order.params)
        except Exception as e:  # InvalidRequestError (bad ids, too long, duplicate), or a bug
            logger.warning("request %s (attempt %d): prefill order rejected: %r", *key, e)
            self.connector.reject(order, str(e))
            return
        req.kv_export = True
        req.attempt = key[1]
        bs = core.config.cache.block_size
        n = -(-len(order.prompt_token_ids) // bs)
        self._exports[eid] = _Export(key, order.first_block, order.first_block, n, ev.waited_s)
        self._keys[eid] = key
        self.num_orders += 1

    def after_schedule(self, core: EngineHandle, sched: SchedulerOutput) -> None:
        return None

    def after_step(
        self, core: EngineHandle, sched: SchedulerOutput, finished: list[Request]
    ) -> list[EngineCoreOutput]:
        bs = core.config.cache.block_size
        done = {r.request_id for r in finished}
        exporting = any(s.request.request_id in self._exports for s in sched.scheduled)
        if exporting:
            core.wait_step_done()  # the NIC must not read blocks still being written
        for s in sched.scheduled:
            eid = s.request.request_id
            exp = self._exports.get(eid)
            if exp is None:
                continue
            req = s.request
            if eid in done:  # its blocks are in a hold now: this role owns it
                hold = (eid, req.attempt)
                block_ids = core.kv.hold_block_ids(hold)
                del self._exports[eid]
                self._held[exp.key] = hold
                src = block_ids[exp.next_block : exp.num_blocks]
                lp = req.output_logprobs[0] if req.output_logprobs else None
                t = core.first_token_timings(req)  # its arrival here = the order's
                timing = (exp.waited_s + (t.queue_s or 0.0), t.prefill_s or 0.0)
                first = req.output_token_ids[0]
                top = req.output_top_logprobs[0] if req.output_top_logprobs else None
                plp = (
                    req.prompt_logprobs if req.sampling_params.prompt_logprobs is not None else None
                )
                self.connector.finish(
                    exp.key, src, exp.next_block, first, lp, timing, top=top, prompt_logprobs=plp
                )
                continue
            full = min(req.num_computed_tokens // bs, exp.num_blocks)
            if full > exp.next_block:
                block_ids = core.kv.get_block_ids(eid)
                self.connector.send_blocks(
                    exp.key, block_ids[exp.next_block : full], exp.next_block
                )
                exp.next_block = full
        if exporting:
            self.connector.flush(self.flush_s)
        # Outputs of exported requests are internal: drop them from this step's results.
        return []

    def on_abort(self, core: EngineHandle, req: Request, hold_key: HoldKey | None) -> None:
        eid = req.request_id
        self._exports.pop(eid, None)
        key = self._keys.get(eid)
        if key is None:
            if hold_key is not None:  # not an export we track: nothing reads its blocks
                core.kv.release_hold(hold_key)
            return
        if hold_key is not None:
            self._held[key] = hold_key
        if not self.connector.end(key, req.error or "aborted"):
            # the connector has settled this attempt already: nothing reads the blocks
            self._keys.pop(eid, None)
            if hold_key is not None:
                del self._held[key]
                core.kv.release_hold(hold_key)

    def claimed_holds(self) -> set[HoldKey]:
        return set(self._held.values())

    def wait_sockets(self) -> list:
        return self.connector.wait_sockets()

    def has_pending(self) -> bool:
        return bool(self._held) or self.connector.has_pending()

    def owns(self, request_id: str) -> bool:
        return request_id in self._exports or request_id in self._keys

    def check_integrity(self) -> None:
        self.connector.check_integrity()

    def shutdown(self) -> None:
        self.connector.close()

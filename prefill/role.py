"""PrefillRole: the engine hooks that export prompt KV to decode nodes."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.core import EngineCore
from engine.errors import InvalidRequestError
from engine.outputs import EngineCoreOutput
from engine.request import Request
from engine.scheduler import SchedulerOutput
from kv_transfer.base import KVConnector, NewOrder, OrderAborted, SendDone, SendFailed

logger = logging.getLogger(__name__)


@dataclass
class _Export:
    first_block: int  # decode holds prompt blocks [0, first_block) already
    next_block: int  # next prompt block to push
    num_blocks: int  # prompt blocks in all


class PrefillRole:
    accepts_remote_prefill = False

    def __init__(self, connector: KVConnector):
        self.connector = connector
        self._exports: dict[str, _Export] = {}
        self._held: dict[str, str] = {}  # request id -> hold key until SendDone/SendFailed
        self.num_orders = 0
        self.bytes_sent = 0

    def attach(self, core: EngineCore) -> None:
        self.connector.register_kv_cache(core.runner.kv_cache)

    def stats(self) -> dict[str, int]:
        return {"pd_orders": self.num_orders, "kv_bytes_sent": self.bytes_sent}

    def before_step(self, core: EngineCore) -> list[EngineCoreOutput]:
        for ev in self.connector.poll():
            if isinstance(ev, NewOrder):
                self._start(core, ev.order)
            elif isinstance(ev, OrderAborted):
                self._exports.pop(ev.request_id, None)
                core.abort_requests([ev.request_id])  # -> on_abort holds the blocks
                self.connector.settle_abort(ev.request_id)
            elif isinstance(ev, (SendDone, SendFailed)):
                if isinstance(ev, SendDone):
                    self.bytes_sent += ev.bytes
                else:
                    logger.warning("request %s: KV export ended: %s", ev.request_id, ev.reason)
                    if ev.request_id in core.requests:  # still computing: stop it
                        self._exports.pop(ev.request_id, None)
                        core.abort_requests([ev.request_id])
                key = self._held.pop(ev.request_id, None)
                if key is not None:
                    core.kv.release(key)
        return []  # prefill-order requests produce nothing for this node's own clients

    def _start(self, core: EngineCore, order) -> None:
        rid = order.request_id
        try:
            req = core.add_request(rid, order.prompt_token_ids, order.params)
        except InvalidRequestError as e:
            logger.warning("request %s: prefill order rejected: %s", rid, e)
            self.connector.reject(order, str(e))
            return
        req.kv_export = True
        bs = core.config.cache.block_size
        n = -(-len(order.prompt_token_ids) // bs)
        self._exports[rid] = _Export(order.first_block, order.first_block, n)
        self.num_orders += 1

    def after_schedule(self, core: EngineCore, sched: SchedulerOutput) -> None:
        return None

    def after_step(
        self, core: EngineCore, sched: SchedulerOutput, finished: list[Request]
    ) -> list[EngineCoreOutput]:
        bs = core.config.cache.block_size
        done = {r.request_id: r for r in finished}
        for s in sched.scheduled:
            rid = s.request.request_id
            exp = self._exports.get(rid)
            if exp is None:
                continue
            req = s.request
            # A request that finished this step has its blocks under its hold key.
            owner = core.kv.hold_key(rid) if rid in done else rid
            block_ids = core.kv.get_block_ids(owner)
            if rid in done:
                src = block_ids[exp.next_block : exp.num_blocks]
                first = exp.next_block
                del self._exports[rid]
                self._held[rid] = owner
                lp = req.output_logprobs[0] if req.output_logprobs else None
                self.connector.finish(rid, src, first, req.output_token_ids[0], lp)
                continue
            full = min(req.num_computed_tokens // bs, exp.num_blocks)
            if full > exp.next_block:
                self.connector.send_blocks(rid, block_ids[exp.next_block : full], exp.next_block)
                exp.next_block = full
        # Outputs of exported requests are internal: drop them from this step's results.
        return []

    def on_abort(self, core: EngineCore, req: Request, hold_key: str | None) -> None:
        self._exports.pop(req.request_id, None)
        if hold_key is not None:
            self._held[req.request_id] = hold_key
            self.connector.settle_abort(req.request_id)

    def wait_sockets(self) -> list:
        return self.connector.wait_sockets()

    def has_pending(self) -> bool:
        return bool(self._held) or self.connector.has_pending()

    def owns(self, request_id: str) -> bool:
        return request_id in self._exports or request_id in self._held

    def check_integrity(self) -> None:
        self.connector.check_integrity()

    def shutdown(self) -> None:
        self.connector.close()

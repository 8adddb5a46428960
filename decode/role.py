"""DecodeRole: the engine hooks that import prompt KV from prefill nodes."""

from __future__ import annotations

import logging

import msgspec

from engine.core import EngineCore
from engine.model_runner import kv_bytes_per_block
from engine.outputs import EngineCoreOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from kv_transfer.base import KVConnector, RecvDone, RecvFailed, Released
from kv_transfer.messages import PrefillOrder

logger = logging.getLogger(__name__)


class DecodeRole:
    accepts_remote_prefill = True

    def __init__(
        self,
        connector: KVConnector,
        transfer_timeout_s: float = 60.0,
        prefill_locally_on_failure: bool = True,
    ):
        self.connector = connector
        self.transfer_timeout_s = transfer_timeout_s
        self.prefill_locally_on_failure = prefill_locally_on_failure
        self._held: dict[str, str] = {}  # request id -> hold key, until Released
        self.num_remote_prefills = 0
        self.num_failures = 0
        self.bytes_received = 0
        self._block_bytes = 0  # one block, every layer, K and V

    def attach(self, core: EngineCore) -> None:
        cfg = core.config
        self._block_bytes = kv_bytes_per_block(
            core.arch, cfg.cache.block_size, cfg.model.torch_dtype
        )
        self.connector.register_kv_cache(core.runner.kv_cache)

    def stats(self) -> dict[str, int]:
        return {
            "pd_remote_prefills": self.num_remote_prefills,
            "pd_failures": self.num_failures,
            "kv_bytes_received": self.bytes_received,
        }

    def before_step(self, core: EngineCore) -> list[EngineCoreOutput]:
        outs: list[EngineCoreOutput] = []
        sched = core.scheduler
        for ev in self.connector.poll():
            rid = ev.request_id
            if isinstance(ev, Released):
                key = self._held.pop(rid, None)
                if key is not None:
                    core.kv.release(key)
                continue
            if rid not in sched.remote_waiting:
                continue  # aborted meanwhile: its blocks are held until Released
            if isinstance(ev, RecvDone):
                self.bytes_received += ev.num_blocks * self._block_bytes
                req = sched.remote_kv_ready(rid, ev.first_token, ev.logprob)
                outs.append(
                    core.make_output(
                        req, [ev.first_token], None if ev.logprob is None else [ev.logprob]
                    )
                )
                if req.is_finished:
                    core.requests.pop(rid, None)
            elif isinstance(ev, RecvFailed):
                self.num_failures += 1
                local = self.prefill_locally_on_failure
                logger.warning(
                    "request %s: remote prefill failed (%s); %s",
                    rid,
                    ev.reason,
                    "prefilling locally" if local else "ending the request",
                )
                self._held[rid] = sched.remote_kv_failed(rid, local, ev.reason)
                if not local:
                    req = core.requests.pop(rid)
                    outs.append(core.make_output(req, []))
        return outs

    def after_schedule(self, core: EngineCore, sched: SchedulerOutput) -> None:
        bs = core.config.cache.block_size
        for req in sched.remote_prefills:
            first_block = req.num_computed_tokens // bs
            block_ids = core.kv.get_block_ids(req.request_id)
            order = PrefillOrder(
                request_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                params=_first_token_params(req),
                decode_agent=self.connector.local_name,
                first_block=first_block,
                dst_block_ids=block_ids[first_block:],
                expires_in_s=self.transfer_timeout_s,
            )
            self.connector.request_prefill(order, req.remote_prefill)
            self.num_remote_prefills += 1

    def after_step(self, core, sched, finished) -> list[EngineCoreOutput]:
        return []

    def on_abort(self, core: EngineCore, req: Request, hold_key: str | None) -> None:
        if hold_key is None:
            return
        # Aborted while its KV was in flight: stop the prefill; free on Released.
        self.connector.cancel(req.request_id)
        self._held[req.request_id] = hold_key

    def wait_sockets(self) -> list:
        return self.connector.wait_sockets()

    def has_pending(self) -> bool:
        return bool(self._held) or self.connector.has_pending()

    def check_integrity(self) -> None:
        self.connector.check_integrity()

    def shutdown(self) -> None:
        self.connector.close()


def _first_token_params(req: Request) -> SamplingParams:
    """The prefill node samples exactly one token, with the request's own parameters."""
    return msgspec.structs.replace(req.sampling_params, max_tokens=1)

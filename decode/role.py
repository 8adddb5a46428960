"""DecodeRole: the engine hooks that import prompt KV from prefill nodes.

Each remote prefill is one transfer attempt `(request_id, attempt)`, with an attempt
number unique on this node, so a retried request (same id) never meets an earlier
attempt. When an attempt fails (rejected, peer dead, WRITE failed, deadline) the request
fails over at once: to another live prefill node it has not tried, else it is prefilled
here (or ends with an error). The failed attempt's blocks stay held, owned by this role,
until the connector reports `Released` (the prefill node confirmed nothing more lands,
or its connection was fenced and the last lease on it ran out). The core never releases
them. Orders carry their deadline as a duration (`ttl_s`), never a wall-clock time.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time

import msgspec

from pdserve.decode.poison import PoisonAudit, poison_enabled
from pdserve.engine.kv_cache_manager import HoldKey
from pdserve.engine.kv_role import EngineHandle
from pdserve.engine.model_build import kv_bytes_per_block
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kv_transfer.base import DecodeConnector, RecvDone, RecvFailed, Released
from pdserve.kv_transfer.messages import PrefillOrder

logger = logging.getLogger(__name__)


class DecodeRole:
    accepts_remote_prefill = True

    def __init__(
        self,
        connector: DecodeConnector,
        transfer_timeout_s: float = 60.0,
        prefill_locally_on_failure: bool = True,
        prefill_nodes: tuple[str, ...] = (),
        checksums: bool = True,
        fallback_warn_share: float = 0.2,
    ):
        """`prefill_nodes`: where a failed remote prefill may be retried (live ones only).
        `checksums`: orders ask for per-block checksums, verified on landing.
        `fallback_warn_share`: warn when more of the recent remote prefills than this share
        ended prefilled here (`FallbackWatch`)."""
        self.connector = connector
        self.checksums = checksums
        self.fallbacks = FallbackWatch(fallback_warn_share)
        self.transfer_timeout_s = transfer_timeout_s
        self.prefill_locally_on_failure = prefill_locally_on_failure
        self.prefill_nodes = prefill_nodes
        self._attempts = itertools.count(1)
        self._held: set[HoldKey] = set()  # holds this role owns, until Released
        self._tried: dict[str, set[str]] = {}  # request id -> prefill nodes tried
        self._outs: list[EngineCoreOutput] = []  # produced in after_schedule, sent after_step
        self.num_remote_prefills = 0
        self.num_failures = 0
        self.num_failovers = 0
        self.bytes_received = 0
        self._block_bytes = 0  # one block, every layer, K and V
        self.poison: PoisonAudit | None = None  # debug: PDSERVE_KV_POISON=1 (decode/poison.py)

    def attach(self, core: EngineHandle) -> None:
        cfg = core.config
        self._block_bytes = kv_bytes_per_block(
            core.arch, cfg.cache.block_size, cfg.model.torch_dtype
        )
        self.connector.register_kv_cache(core.kv_ranks or core.kv_cache)
        self.connector.vocab_size = core.arch.vocab_size
        if poison_enabled():
            self.poison = PoisonAudit(core.kv_cache)

    def stats(self) -> dict[str, int]:
        return {
            "pd_remote_prefills": self.num_remote_prefills,
            "pd_failures": self.num_failures,
            "pd_bad_dones": self.connector.num_bad_dones,
            "kv_checksum_mismatches": self.connector.num_checksum_mismatches,
            "kv_data_fences": self.connector.num_data_fences,
            "kv_bytes_received": self.bytes_received,
            "kv_poison_violations": self.poison.violations if self.poison else 0,
        }

    def before_step(self, core: EngineHandle) -> list[EngineCoreOutput]:
        outs: list[EngineCoreOutput] = []
        sched = core.scheduler
        for ev in self.connector.poll():
            rid, attempt = ev.key
            if isinstance(ev, Released):
                if ev.key in self._held:
                    self._held.discard(ev.key)
                    blocks = core.kv.holds[ev.key]
                    core.kv.release_hold(ev.key)
                    if self.poison is not None:  # those now free and in no prefix cache
                        self.poison.poison(
                            [b.block_id for b in blocks if not b.ref_cnt and b.block_hash is None]
                        )
                continue
            req = sched.remote_waiting.get(rid)
            if req is None or req.attempt != attempt:
                continue  # aborted meanwhile: its hold is released on Released
            if isinstance(ev, RecvDone):
                self._tried.pop(rid, None)
                self.fallbacks.record(False)
                self.bytes_received += ev.num_blocks * self._block_bytes
                req = sched.remote_kv_ready(rid, ev.first_token, ev.logprob, ev.top)
                req.kv_done_time, (queue, compute) = time.monotonic(), ev.prefill_node_s
                # the prefill node's queue time is its own measure: never more of the
                # round trip than the prefill compute left
                queue = min(queue, max(0.0, req.kv_done_time - req.kv_order_time - compute))
                req.prefill_node_s = (queue, compute)
                if ev.prompt_logprobs is not None:  # checked against the order's prompt
                    req.prompt_logprobs = ev.prompt_logprobs
                lp = None if ev.logprob is None else [ev.logprob]
                top = None if ev.top is None else [ev.top]
                outs.append(core.make_output(req, [ev.first_token], lp, top))
                if req.is_finished:
                    core.requests.pop(rid, None)
            elif isinstance(ev, RecvFailed):
                outs += self._failed(core, req, ev.reason, ev.checksum_mismatch)
        return outs

    def _failed(
        self, core: EngineHandle, req: Request, reason: str, mismatch: bool = False
    ) -> list[EngineCoreOutput]:
        rid = req.request_id
        self.num_failures += 1
        if mismatch or req.prefill_fallback is None:  # what `pdserve_timings` will say
            req.prefill_fallback = (
                "local_checksum_mismatch" if mismatch else "local_transfer_failed"
            )
        failed_node = req.remote_prefill
        tried = self._tried.setdefault(rid, set())
        tried.add(failed_node)
        other = next(
            (n for n in self.prefill_nodes if n not in tried and self.connector.peer_alive(n)),
            None,
        )
        local = other is not None or self.prefill_locally_on_failure
        what = f"retrying on {other}" if other else "prefilling locally" if local else "ending it"
        logger.warning("request %s: remote prefill failed (%s); %s", rid, reason, what)
        self._held.add(core.scheduler.remote_kv_failed(rid, local, reason))
        if other is not None:
            self.num_failovers += 1
            req.remote_prefill = other  # back in the queue as a remote prefill there
            return []
        self._tried.pop(rid, None)
        self.fallbacks.record(True)
        if not local:
            core.requests.pop(rid, None)
            return [core.make_output(req, [])]
        return []

    def after_schedule(self, core: EngineHandle, sched: SchedulerOutput) -> None:
        bs = core.config.cache.block_size
        if self.poison is not None:  # blocks handed out this step, before anything writes
            self.poison.scan()
            for r in [s.request for s in sched.scheduled] + list(sched.remote_prefills):
                self.poison.check(core.kv.get_block_ids(r.request_id), "handed out")
        for req in sched.remote_prefills:
            req.attempt = next(self._attempts)
            first_block = req.num_computed_tokens // bs
            block_ids = core.kv.get_block_ids(req.request_id)
            try:
                order = PrefillOrder(
                    request_id=req.request_id,
                    attempt=req.attempt,
                    prompt_token_ids=req.prompt_token_ids,
                    params=_first_token_params(req),
                    decode_agent=self.connector.local_name,
                    first_block=first_block,
                    dst_block_ids=block_ids[first_block:],
                    ttl_s=self.transfer_timeout_s,
                    checksums=self.checksums,
                )
            except ValueError as e:  # confined to this request: nothing was sent
                self._outs += self._failed(core, req, f"cannot order its prefill: {e}")
                key = (req.request_id, req.attempt)
                self._held.discard(key)
                core.kv.release_hold(key)
                continue
            req.kv_order_time = time.monotonic()
            self.connector.request_prefill(order, req.remote_prefill)
            self.num_remote_prefills += 1

    def after_step(self, core, sched, finished) -> list[EngineCoreOutput]:
        outs, self._outs = self._outs, []
        return outs

    def on_abort(self, core: EngineHandle, req: Request, hold_key: HoldKey | None) -> None:
        self._tried.pop(req.request_id, None)
        if hold_key is None:
            return
        # Aborted while its KV was in flight: stop the prefill; the hold is released
        # only on Released (the prefill node acknowledged, or deadline plus grace).
        self._held.add(hold_key)
        self.connector.cancel(hold_key)

    def claimed_holds(self) -> set[HoldKey]:
        return self._held

    def wait_sockets(self) -> list:
        return self.connector.wait_sockets()

    def has_pending(self) -> bool:
        return bool(self._held) or self.connector.has_pending()

    def check_integrity(self) -> None:
        self.connector.check_integrity()

    def shutdown(self) -> None:
        self.connector.close()


class FallbackWatch:
    """The share of recent remote prefills (the last `window`) that ended prefilled here
    after their transfer failed; a warning, at most once a minute, while it exceeds
    `warn_share` (a node that silently recomputes is slow and costs the cluster twice)."""

    def __init__(self, warn_share: float, window: int = 100, min_count: int = 20):
        self.warn_share, self.min_count = warn_share, min_count
        self.recent: collections.deque[bool] = collections.deque(maxlen=window)
        self._warned_at = float("-inf")

    def record(self, fell_back: bool) -> None:
        self.recent.append(fell_back)
        share = sum(self.recent) / len(self.recent)
        now = time.monotonic()
        if len(self.recent) >= self.min_count and share > self.warn_share:
            if now - self._warned_at >= 60.0:
                self._warned_at = now
                logger.warning(
                    "%.0f%% of the last %d remote prefills were computed here after their "
                    "transfer failed (warning above %.0f%%, kv_transfer.fallback_warn_share)",
                    100 * share, len(self.recent), 100 * self.warn_share,
                )  # fmt: skip


def _first_token_params(req: Request) -> SamplingParams:
    """The prefill node samples exactly one token, with the request's own parameters."""
    return msgspec.structs.replace(req.sampling_params, max_tokens=1)

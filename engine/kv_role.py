"""The hooks through which a PD role drives KV transfers from the engine loop.

A colocated node has no role. A decode node's role imports KV (orders prefills, polls for
arrivals, enforces deadlines); a prefill node's role exports it (takes orders, pushes
blocks as chunks finish, reports completion). Every hook runs on the engine thread,
between steps, so a role never races the scheduler; none may block for long.

A role sees the engine only through `EngineHandle`, the narrow interface `EngineCore`
implements and hands to every hook: the role needs no import of the core.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.kv_cache_manager import HoldKey, KVCacheManager
    from pdserve.engine.model_arch import ModelArch
    from pdserve.engine.outputs import EngineCoreOutput, RequestTimings, TokenLogprobs
    from pdserve.engine.request import Request, RequestStatus
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import Scheduler, SchedulerOutput


class EngineHandle(Protocol):
    """What a KV role may use of its engine (`EngineCore` implements it).

    The KV cache manager (`kv`: block ids, holds), the scheduler (remote-KV waits), the
    live requests by id, and the few operations below. Valid only on the engine thread,
    inside a hook.
    """

    config: EngineConfig
    arch: ModelArch
    kv: KVCacheManager
    scheduler: Scheduler
    requests: dict[str, Request]

    @property
    def kv_cache(self) -> Any:
        """The model's KV cache tensors (what a connector registers)."""
        ...

    @property
    def kv_ranks(self) -> Any:
        """A tensor-parallel CPU node's every rank's KV cache (`KVRanks`); None for one device."""
        ...

    def wait_step_done(self) -> None:
        """Block until the last step's kernels finished writing the KV cache."""
        ...

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request: ...

    def end_request(
        self, request_id: str, status: RequestStatus, error: str | None = None
    ) -> EngineCoreOutput | None: ...

    def make_output(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[float] | None = None,
        top: list[TokenLogprobs] | None = None,
    ) -> EngineCoreOutput: ...

    def first_token_timings(self, req: Request) -> RequestTimings: ...


class KVRole(Protocol):
    accepts_remote_prefill: bool  # decode role: requests may name a prefill node

    def attach(self, core: EngineHandle) -> None:
        """Called once the engine exists: register its KV cache with the connector."""
        ...

    def before_step(self, core: EngineHandle) -> list[EngineCoreOutput]:
        """Poll transfers and control messages; apply arrivals, failures, new orders."""
        ...

    def after_schedule(self, core: EngineHandle, sched: SchedulerOutput) -> None:
        """React to this step's schedule (e.g. send prefill orders for newly admitted ones)."""
        ...

    def after_step(
        self, core: EngineHandle, sched: SchedulerOutput, finished: list[Request]
    ) -> list[EngineCoreOutput]:
        """After the model ran: push newly computed blocks, settle finished requests."""
        ...

    def on_abort(self, core: EngineHandle, req: Request, hold_key: HoldKey | None) -> None:
        """A request ended early (abort, error, dropped export). `hold_key` names its blocks,
        kept out of circulation: the role now owns that hold and alone releases it, once
        no transfer can touch the blocks."""
        ...

    def claimed_holds(self) -> Collection[HoldKey]:
        """Every hold this role owns (`check_integrity` asserts they are exactly the KV
        cache manager's holds)."""
        ...

    def wait_sockets(self) -> list:
        """ZMQ sockets whose readability means this role has work (the idle loop waits on them)."""
        ...

    def has_pending(self) -> bool:
        """True while transfers or held blocks need polling even with no request to run."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for EngineStats (names of its PD fields)."""
        ...

    def check_integrity(self) -> None: ...

    def shutdown(self) -> None: ...

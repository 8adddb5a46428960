"""The hooks through which a PD role drives KV transfers from the engine loop.

A colocated node has no role. A decode node's role imports KV (orders prefills, polls for
arrivals, enforces deadlines); a prefill node's role exports it (takes orders, pushes
blocks as chunks finish, reports completion). Every hook runs on the engine thread,
between steps, so a role never races the scheduler; none may block for long.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.engine.core import EngineCore
    from pdserve.engine.kv_cache_manager import HoldKey
    from pdserve.engine.outputs import EngineCoreOutput
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import SchedulerOutput


class KVRole(Protocol):
    accepts_remote_prefill: bool  # decode role: requests may name a prefill node

    def attach(self, core: EngineCore) -> None:
        """Called once the engine exists: register its KV cache with the connector."""
        ...

    def before_step(self, core: EngineCore) -> list[EngineCoreOutput]:
        """Poll transfers and control messages; apply arrivals, failures, new orders."""
        ...

    def after_schedule(self, core: EngineCore, sched: SchedulerOutput) -> None:
        """React to this step's schedule (e.g. send prefill orders for newly admitted ones)."""
        ...

    def after_step(
        self, core: EngineCore, sched: SchedulerOutput, finished: list[Request]
    ) -> list[EngineCoreOutput]:
        """After the model ran: push newly computed blocks, settle finished requests."""
        ...

    def on_abort(self, core: EngineCore, req: Request, hold_key: HoldKey | None) -> None:
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

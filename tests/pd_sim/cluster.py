"""A simulated PD cluster: one decode node and N prefill nodes, each a real `EngineCore`
(real scheduler, real KV cache manager) with its real role and connector side, over the
in-memory world of `world.py`. Every host has a clock of its own (`Clocks`: offset and
rate error). `step()` advances time, pumps every live prefill node's control channel and
steps every live node whose engine is not hung, then checks the invariants; the scenario
tests and the seeded sweep drive it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.decode.role import DecodeRole
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.request import RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.control_channel import DecodeControl, PrefillControl
from pdserve.kv_transfer.decode_side import DecodeSide
from pdserve.kv_transfer.prefill_side import PrefillSide
from pdserve.prefill.role import PrefillRole
from tests.pd_sim.stub_model import StubRunner, expected_output, stub_arch
from tests.pd_sim.world import (
    Faults,
    SimData,
    SimDealerLink,
    SimPump,
    SimRouterLink,
    SimWrite,
    World,
)


class InvariantViolation(AssertionError):
    pass


@dataclass
class Timing:
    transfer_timeout_s: float = 1.0
    # The protocol's one timing assumption (durations only): a WRITE posted while the
    # lease ran lands or fails within the grace (its latency plus how long a cancelled
    # one may still land). A prefill step longer than it costs a fence, never safety.
    abort_grace_s: float = 1.5
    peer_timeout_s: float = 0.4
    heartbeat_s: float = 0.1
    dt: float = 0.02
    idle_close_s: float = 60.0


@dataclass
class Clocks:
    """Each host's clock: (offset, rate); index 0 is the decode node."""

    hosts: list[tuple[float, float]] = field(default_factory=list)

    def of(self, i: int) -> tuple[float, float]:
        return self.hosts[i] if i < len(self.hosts) else (0.0, 1.0)


@dataclass
class Tracked:
    prompt: list[int]
    max_tokens: int
    arrival: float
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    ended_at: float | None = None


def _config(name: str, num_blocks: int, budget: int, caching: bool = True) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(name),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, local_prefill_max_tokens=4),
        num_threads=1,
    )


class Cluster:
    def __init__(
        self,
        seed: int = 0,
        faults: Faults | None = None,
        timing: Timing | None = None,
        num_prefill: int = 2,
        decode_blocks: int = 64,
        prefill_blocks: int = 48,
        prefill_budget: int = 8,
        prefill_locally: bool = True,
        clocks: Clocks | None = None,
        decode_caching: bool = True,
    ):
        self.world = w = World(seed, faults)
        self.t = t = timing or Timing()
        clocks = clocks or Clocks()
        self.clocks = [w.host_clock(*clocks.of(i)) for i in range(num_prefill + 1)]
        self.addrs = [f"sim://p{i}" for i in range(num_prefill)]
        self.prefills: dict[str, EngineCore] = {}
        self.routers: dict[str, SimRouterLink] = {}
        self.pumps: dict[str, SimPump] = {}
        self.stalled_until: dict[str, float] = {}  # the whole process stopped (SIGSTOP)
        self.hung_until: dict[str, float] = {}  # the engine thread only: the pump runs
        self.dead: set[str] = set()
        for i, addr in enumerate(self.addrs):
            router = SimRouterLink(w, addr)
            clock = self.clocks[i + 1]
            pump = self.pumps[addr] = SimPump(router, clock)
            control = PrefillControl(addr, pump, clock=clock)
            pump.screen = control._screen
            side = PrefillSide(
                control,
                lambda kv, n=f"p{i}": SimData(w, n, kv),
                grace_s=t.abort_grace_s / 2,
                clock=clock,
            )
            core = EngineCore(
                _config(f"p{i}", prefill_blocks, prefill_budget),
                PrefillRole(side, flush_s=0.0),  # sim WRITEs move only as the clock does
                arch=stub_arch(),
                runner_factory=StubRunner,
            )
            self.prefills[addr], self.routers[addr] = core, router
            core.runner.on_execute = self._long_step
        self.dside = DecodeSide(
            lambda hello: DecodeControl(
                hello,
                heartbeat_s=t.heartbeat_s,
                peer_timeout_s=t.peer_timeout_s,
                idle_close_s=t.idle_close_s,
                clock=self.clocks[0],
                connect=lambda node: SimDealerLink(w, node, b"d"),
            ),
            lambda kv: SimData(w, "d", kv),
            abort_grace_s=t.abort_grace_s,
            clock=self.clocks[0],
        )
        self.drole = DecodeRole(
            self.dside,
            transfer_timeout_s=t.transfer_timeout_s,
            prefill_locally_on_failure=prefill_locally,
            prefill_nodes=tuple(self.addrs),
        )
        self.decode = EngineCore(
            _config("d", decode_blocks, 64, decode_caching),
            self.drole,
            arch=stub_arch(),
            runner_factory=StubRunner,
        )
        self.reqs: dict[str, Tracked] = {}
        w.on_post = self._tag_write
        w.on_land = self._check_landing
        self.steps = 0

    def _long_step(self) -> None:
        if self.world.faults.step_time:
            self.world.advance(self.world.delay(self.world.faults.step_time))

    # -- driving ---------------------------------------------------------------------------
    def submit(self, rid: str, prompt: list[int], max_tokens: int, node: str | None = None):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.decode.add_request(rid, prompt, params, remote_prefill=node or self.addrs[0])
        self.reqs[rid] = Tracked(prompt, max_tokens, self.world.now)

    def abort(self, rid: str) -> None:
        for o in self.decode.abort_requests([rid]):
            self._record(o)

    def kill(self, addr: str) -> None:
        self.dead.add(addr)
        self.routers[addr].dead = True

    def stall(self, addr: str, seconds: float) -> None:
        """The whole prefill process stops (SIGSTOP): nothing answers."""
        self.stalled_until[addr] = self.world.now + seconds

    def hang(self, addr: str, seconds: float) -> None:
        """Only the prefill engine thread stops: its pump still answers heartbeats."""
        self.hung_until[addr] = self.world.now + seconds

    def reconnect(self, addr: str) -> None:
        """The decode node drops its connection to `addr` (a new one replaces it)."""
        self.dside.control.fence(addr)

    def step(self) -> None:
        self.world.advance(self.t.dt)
        self._hold_unprogressed_writes()
        for o in self.decode.step():
            self._record(o)
        now = self.world.now
        for addr, core in self.prefills.items():
            if addr not in self.dead and self.stalled_until.get(addr, 0) <= now:
                self.pumps[addr].pump()
                if self.hung_until.get(addr, 0) <= now:
                    assert core.step() == []
                    for w in self.world.writes:  # it ran: its WRITEs move again
                        w.held = w.held and w.plane.name != f"p{self.addrs.index(addr)}"
        self.steps += 1
        self.check_step()

    def _hold_unprogressed_writes(self) -> None:
        """A node's NIXL moves data only while its engine thread calls into it (the
        connector runs no progress thread): a WRITE of a node that is stopped, hung or
        dead moves no further than what the kernel already holds (`Faults.drain_s`).
        A dead node's lands by then; a stopped or hung node's is held until the node
        runs again, and cancelling it then lands nothing more (see `SimData.release`)."""
        now, names = self.world.now, {f"p{i}": a for i, a in enumerate(self.addrs)}
        drain = self.world.faults.drain_s
        for w in self.world.writes:
            addr = names.get(w.plane.name)
            if addr is None or w.at <= now + drain:
                continue
            if addr in self.dead:
                w.at = now + drain
            elif max(self.stalled_until.get(addr, 0), self.hung_until.get(addr, 0)) > now:
                w.at, w.held = w.at + self.t.dt, True

    def run_until_idle(self, max_s: float = 60.0) -> None:
        end = self.world.now + max_s
        while not self.idle():
            if self.world.now > end:
                raise InvariantViolation(f"not idle after {max_s} s: {self.describe()}")
            self.step()

    def idle(self) -> bool:
        live = [c for a, c in self.prefills.items() if a not in self.dead]
        return not self.decode.has_unfinished and not any(c.has_unfinished for c in live)

    def _record(self, o) -> None:
        tr = self.reqs[o.request_id]
        tr.tokens += o.new_token_ids
        if o.finish_reason is not None:
            tr.finish, tr.error, tr.ended_at = o.finish_reason, o.error, self.world.now

    # -- invariants ------------------------------------------------------------------------
    def _owner_ok(self, key: tuple[str, int], blocks: list[int]) -> bool:
        kv, (rid, attempt) = self.decode.kv, key
        owned = set(kv.hold_block_ids(key))
        req = self.decode.scheduler.remote_waiting.get(rid)
        if req is not None and req.attempt == attempt:
            owned |= set(kv.get_block_ids(rid))
        return set(blocks) <= owned

    def _tag_write(self, w: SimWrite) -> None:
        if w.peer.name != "d":
            return
        for key, att in self.dside._attempts.items():
            if set(w.dst) <= set(att.order.dst_block_ids):
                w.key = key
                return
        raise InvariantViolation(f"WRITE into {w.dst} posted for no live decode attempt")

    def _check_landing(self, w: SimWrite) -> None:
        if w.peer.name == "d" and not self._owner_ok(w.key, w.dst):
            raise InvariantViolation(f"WRITE of {w.key} landed in reused blocks {w.dst}")

    def check_step(self) -> None:
        for w in self.world.writes:  # a block is never reused while a WRITE may land in it
            # (a held WRITE cannot land before its sender runs: checked if it ever lands)
            if w.peer.name == "d" and not w.held and not self._owner_ok(w.key, w.dst):
                raise InvariantViolation(f"blocks {w.dst} reused under a WRITE of {w.key}")
        self.decode.check_integrity()
        for addr, core in self.prefills.items():
            if addr not in self.dead:
                core.check_integrity()
        # prefill steps may stretch a tick (the clock moves while they execute); each
        # host's deadlines are on its own clock, so compare them there
        slack = 2 * self.t.dt + self.world.faults.step_time * len(self.prefills)
        dnow = self.clocks[0]()
        for key, att in self.dside._attempts.items():  # every decode state ends in time
            end = {"ordered": att.deadline, "fenced": att.release_at}.get(
                att.state.value, att.end_by
            )
            if dnow > end + 2 * slack:
                raise InvariantViolation(f"decode attempt {key} still {att.state} past {end}")
        step, now = self.world.faults.step_time, self.world.now
        for i, (addr, core) in enumerate(self.prefills.items()):  # and every prefill state
            if (
                addr in self.dead
                or max(self.stalled_until.get(addr, 0), self.hung_until.get(addr, 0))
                > now - self.t.dt
            ):
                continue  # fmt: skip
            pnow = self.clocks[i + 1]()
            for key, st in core.kv_role.connector._sends.items():
                end = max(st.deadline + self.t.abort_grace_s / 2, st.quiet_until) + step
                if pnow > end + 2 * slack:
                    raise InvariantViolation(f"prefill attempt {key} still {st.state} past {end}")
        # a request may queue behind blocks held by failed attempts: a looser overall bound
        bound = self.t.transfer_timeout_s + 2 * self.t.abort_grace_s + 1.1 * self.t.peer_timeout_s
        limit = 2 * (len(self.addrs) + 1) * (bound + 4 * self.t.dt) + 3.0
        for rid, tr in self.reqs.items():
            if tr.finish is None and now > tr.arrival + limit:
                raise InvariantViolation(f"request {rid} not ended {limit:.1f} s after arrival")

    def check_final(self) -> None:
        """Pools back to baseline, every request ended right, outputs exactly as expected."""
        self.check_step()
        cores = [self.decode] + [c for a, c in self.prefills.items() if a not in self.dead]
        for core in cores:
            kv = core.kv
            if kv.pool.num_used_blocks or kv.holds or core.requests:
                raise InvariantViolation(f"not at baseline: {self.describe()}")
        if self.dside.has_pending():
            raise InvariantViolation(f"decode connector still tracks {self.dside.states()}")
        for rid, tr in self.reqs.items():
            if tr.finish is None:
                raise InvariantViolation(f"request {rid} never ended")
            if tr.finish in ("length", "stop"):
                if tr.tokens != expected_output(tr.prompt, tr.max_tokens):
                    raise InvariantViolation(f"request {rid} produced wrong tokens")

    def describe(self) -> str:
        d = self.decode
        return (
            f"t={self.world.now - 1000:.2f} decode used={d.kv.pool.num_used_blocks} "
            f"holds={sorted(d.kv.holds)} waiting_kv={list(d.scheduler.remote_waiting)} "
            f"attempts={self.dside.states()} prefill="
            + str({a: (c.kv.pool.num_used_blocks, sorted(c.kv.holds), c.kv_role.connector.states())
                   for a, c in self.prefills.items()})
        )  # fmt: skip

    def status(self, rid: str) -> RequestStatus | None:
        req = self.decode.requests.get(rid)
        return None if req is None else req.status

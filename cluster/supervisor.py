"""Start, watch, restart and stop the processes of a cluster, whatever runs them.

A `Service` is one process (Redis, a node, the router) behind a `Handle` (a local process
or a Ray actor that owns one) plus a health probe. The `Supervisor` starts services in
stages (Redis, then every node at once, then the router), each stage only once the one
before it is healthy; a service that exits or is not healthy within the startup timeout
fails the launch with the tail of its log. Once up, a service that exits is restarted
with exponential backoff (`launcher.restart`); `stop_all()` drains stages in reverse
order: SIGTERM (uvicorn finishes in-flight requests), then SIGKILL after the drain timeout.

Single-threaded by design: every state change happens in `tick()` on the caller's thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.cluster.schema import RestartSection

logger = logging.getLogger(__name__)


KILL_MARGIN_S = 10.0  # after the drain timeout, before SIGKILL: shutdown hooks, exit


class Handle(Protocol):
    pid: int | None

    def start(self) -> None: ...

    def poll(self) -> int | None:
        """None while running, else the exit code."""
        ...

    def signal(self, sig: int) -> None: ...

    def stop(self, grace_s: float) -> int | None: ...

    def tail(self, lines: int = 20) -> str: ...


class LaunchError(RuntimeError):
    """A service did not come up; the message names it and quotes its log."""


@dataclass
class Service:
    name: str
    kind: str  # "redis" | "prefill" | "decode" | "router"
    handle: Handle
    healthy: Callable[[], bool]
    url: str
    log: str = ""
    state: str = "stopped"  # starting | up | backoff | failed | stopped
    restarts: int = 0  # since the last reset
    total_restarts: int = 0
    since: float = field(default_factory=time.monotonic)
    restart_at: float = 0.0
    where: dict = field(default_factory=dict)  # Ray: the node it was placed on

    def set(self, state: str) -> None:
        self.state, self.since = state, time.monotonic()


class Supervisor:
    def __init__(
        self,
        stages: list[list[Service]],
        restart: RestartSection,
        startup_timeout_s: float,
        drain_timeout_s: float,
        say: Callable[[str], None] = print,
        on_change: Callable[[], None] = lambda: None,
        kill_margin_s: float = KILL_MARGIN_S,
    ):
        self.stages = stages
        self.restart = restart
        self.startup_timeout_s = startup_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.say = say
        self.on_change = on_change
        self.kill_margin_s = kill_margin_s
        self.stop_requested = False

    @property
    def services(self) -> list[Service]:
        return [s for stage in self.stages for s in stage]

    # ---- startup ----------------------------------------------------------------------
    def start_all(self, progress_every_s: float = 5.0) -> None:
        """Start stage by stage; raise LaunchError if one does not come up."""
        t0 = time.monotonic()
        for stage in self.stages:
            for svc in stage:
                svc.handle.start()
                svc.set("starting")
            self.on_change()
            next_progress = time.monotonic() + progress_every_s
            while any(s.state != "up" for s in stage):
                if self.stop_requested:
                    raise LaunchError("stopped by a signal during startup")
                for svc in stage:
                    was = svc.state
                    self._check_starting(svc, fail=True)
                    if svc.state != was:
                        self.on_change()  # cluster.json shows each process as it comes up
                if time.monotonic() >= next_progress:
                    waiting = [f"{s.name} ({s.state})" for s in stage if s.state != "up"]
                    elapsed = time.monotonic() - t0
                    self.say(f"[launch] {elapsed:5.0f} s  waiting for {', '.join(waiting)}")
                    next_progress += progress_every_s
                time.sleep(0.2)
            self.on_change()

    def _check_starting(self, svc: Service, fail: bool) -> None:
        if svc.state != "starting":
            return
        code = svc.handle.poll()
        if code is None and svc.healthy():
            svc.set("up")
            return
        timed_out = time.monotonic() - svc.since > self.startup_timeout_s
        if code is None and not timed_out:
            return
        why = f"exited with code {code}" if code is not None else "was not healthy in time"
        if fail:
            raise LaunchError(
                f"{svc.name} {why} (log {svc.log}); last lines:\n{svc.handle.tail(20)}"
            )
        self._crashed(svc, why)

    # ---- supervision ------------------------------------------------------------------
    def tick(self) -> None:
        """One pass: notice exits, restart due services, promote healthy ones."""
        now = time.monotonic()
        for svc in self.services:
            if svc.state == "up":
                code = svc.handle.poll()
                if code is not None:
                    self._crashed(svc, f"exited with code {code}")
                elif svc.restarts and now - svc.since > self.restart.reset_after_s:
                    svc.restarts = 0
            elif svc.state == "backoff" and now >= svc.restart_at:
                svc.restarts += 1
                svc.total_restarts += 1
                self.say(f"[launch] restarting {svc.name} (restart {svc.restarts})")
                try:
                    svc.handle.start()
                except LaunchError as e:  # e.g. its Ray host is lost: the rest runs on
                    self.say(f"[launch] {svc.name} cannot be restarted: {e}")
                    svc.set("failed")
                    self.on_change()
                    continue
                svc.set("starting")
                self.on_change()
            elif svc.state == "starting":
                self._check_starting(svc, fail=False)
                if svc.state == "up":
                    self.say(f"[launch] {svc.name} is back up")
                    self.on_change()

    def _crashed(self, svc: Service, why: str) -> None:
        svc.handle.stop(0)  # whatever it left in its process group goes too
        tail = svc.handle.tail(10)
        if not self.restart.enabled or svc.restarts >= self.restart.max_restarts:
            self.say(f"[launch] {svc.name} {why}; not restarting. Log tail:\n{tail}")
            svc.set("failed")
        else:
            delay = min(self.restart.backoff_s * 2**svc.restarts, self.restart.backoff_max_s)
            self.say(f"[launch] {svc.name} {why}; restarting in {delay:.1f} s")
            logger.debug("%s log tail:\n%s", svc.name, tail)
            svc.set("backoff")
            svc.restart_at = time.monotonic() + delay
        self.on_change()

    def supervise(self, poll_s: float = 0.5) -> None:
        """Run until `stop_requested` is set (by a signal handler)."""
        while not self.stop_requested:
            self.tick()
            time.sleep(poll_s)

    # ---- shutdown ---------------------------------------------------------------------
    def stop_all(self) -> None:
        """Drain and stop every stage in reverse order (router, nodes, Redis)."""
        import signal

        for stage in reversed(self.stages):
            running = [s for s in stage if s.handle.pid is not None]
            for svc in running:
                svc.handle.signal(signal.SIGTERM)
            # The processes drain for drain_timeout_s themselves; SIGKILL only past that.
            deadline = time.monotonic() + self.drain_timeout_s + self.kill_margin_s
            for svc in running:
                svc.handle.stop(max(0.0, deadline - time.monotonic()))
                svc.set("stopped")
        self.on_change()

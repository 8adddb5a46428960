"""A circuit breaker per node: stop sending work to a node that keeps failing.

closed --(`failures` consecutive failures)--> open --(cooldown passed)--> half-open
half-open lets ONE request through: success closes the circuit, failure reopens it with
the cooldown doubled (capped at `max_cooldown_s`). A success in any state resets the count.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(self, failures: int = 3, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0):
        self.threshold = failures
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.consecutive_failures = 0
        self.cooldown_s = cooldown_s
        self.open_until: float | None = None  # None: closed
        self._trial_out = False  # half-open: the one trial request is in flight
        self.on_change: Callable[[], None] | None = None  # called when allows() may change

    @property
    def state(self) -> str:
        if self.open_until is None:
            return "closed"
        return "open" if time.monotonic() < self.open_until else "half_open"

    def allows(self) -> bool:
        """May a new request go to this node now?"""
        state = self.state
        return state == "closed" or (state == "half_open" and not self._trial_out)

    def on_dispatch(self) -> None:
        if self.open_until is not None and self.state == "half_open":
            self._trial_out = True
            self._changed()

    def record_success(self) -> None:
        self.consecutive_failures = 0
        if self.open_until is None:  # closed already: the common case, nothing changes
            return
        self.open_until = None
        self.cooldown_s = self.base_cooldown_s
        self._trial_out = False
        self._changed()

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        half_open = self.state == "half_open"
        if half_open or self.consecutive_failures >= self.threshold:
            if half_open:
                self.cooldown_s = min(self.cooldown_s * 2, self.max_cooldown_s)
            self.open_until = time.monotonic() + self.cooldown_s
            self._trial_out = False
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

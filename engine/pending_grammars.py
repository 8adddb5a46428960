"""Requests whose structured-output grammar is still compiling, held out of the scheduler.

The core parks a constrained request here when its grammar is not cached yet, and each
step collects the ones whose compile finished (or failed, or ran past the deadline).
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.request import Request


class PendingGrammars:
    """Requests whose grammar is still compiling: not yet in the scheduler."""

    def __init__(self, compiler: GrammarCompiler, clock=time.monotonic):
        self.compiler = compiler
        self.clock = clock
        self._waits: dict[str, tuple[Request, Future, float]] = {}

    def __len__(self) -> int:
        return len(self._waits)

    def requests(self) -> list[Request]:
        return [req for req, _, _ in self._waits.values()]

    def start(self, req: Request, grammar: str) -> bool:
        """True if `req.grammar` is set now (a cached compile); else it waits here."""
        fut = self.compiler.submit(grammar)
        if fut.done():
            req.set_grammar(self.compiler.instantiate(fut))  # raises a compile error
            return True
        self._waits[req.request_id] = (req, fut, self.clock() + self.compiler.deadline_s)
        return False

    def discard(self, request_id: str) -> None:
        self._waits.pop(request_id, None)

    def settle(self) -> tuple[list[Request], list[tuple[str, str]]]:
        """(requests whose grammar is ready now, [(request id, error)] for the others that
        failed to compile or ran past the deadline)."""
        ready, failed = [], []
        now = self.clock()
        for rid, (req, fut, deadline) in list(self._waits.items()):
            if fut.done():
                del self._waits[rid]
                try:
                    req.set_grammar(self.compiler.instantiate(fut))
                except Exception as e:  # InvalidRequestError, or llguidance's own
                    failed.append((rid, f"structured output: {e}"))
                    continue
                ready.append(req)
            elif now > deadline:
                del self._waits[rid]
                failed.append(
                    (
                        rid,
                        f"structured output: grammar not compiled in {self.compiler.deadline_s:g} s",
                    )
                )
        return ready, failed

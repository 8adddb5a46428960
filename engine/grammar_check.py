"""Untrusted grammars are first compiled in worker processes that are killed at a deadline.

llguidance has fuel and size caps (`pdserve.engine.grammar.parser_limits`) but no way to
stop a compile from outside, and some schemas within every cap still take seconds (an
`allOf` of `anyOf`s is intersected case by case). A thread cannot be stopped either, so
a compile that outlives its deadline on a thread keeps burning a worker. Here each
compile runs in a child process (`python -m pdserve.engine.grammar_check`), which does
exactly what the engine will do with the grammar: build llguidance's view of the
tokenizer (once, at start), the request's matcher, and its first token mask. A compile
past `deadline_s` has its child killed (SIGKILL) and replaced, and fails its own request
only; a child that dies compiling (out of memory) does the same.

Protocol (JSON lines, no pickle): the child writes `{"ready": true}` once its tokenizer
view is built, then answers each `{"grammar": ...}` line with `{"error": null}` or
`{"error": "..."}`. The workers start on the first check (a node that never sees a
schema pays nothing); a killed one is replaced in the background, one that failed to
start is started again by the next check.

Failure modes of `check`: `GrammarTimeout` (this compile ran past the deadline; the
schema's fault: HTTP 400), `GrammarWorkersBusy` (no worker free within the deadline
plus the start bound: HTTP 429, retry later), or the compile's own error text returned.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a child builds its tokenizer view (about a second, idle)


class GrammarTimeout(Exception):
    """A compile ran past its deadline (its worker was killed)."""


class GrammarWorkersBusy(Exception):
    """No compile worker became free in time: the node is compiling other schemas."""


class _Worker:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def ask(self, grammar: str, timeout_s: float) -> str | None:
        """The compile's error (None: it compiled); `GrammarTimeout` past `timeout_s`."""
        self.proc.stdin.write(json.dumps({"grammar": grammar}) + "\n")
        self.proc.stdin.flush()
        reply = _read_line(self.proc, timeout_s)
        if reply is None:
            raise GrammarTimeout
        return json.loads(reply)["error"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """One line from the child (None: nothing by the deadline, or the child died)."""
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, timeout_s))
    if not ready:
        return None
    line = proc.stdout.readline()
    return line or None


class GrammarCheckPool:
    """`workers` child processes; `check(grammar)` compiles in one, within `deadline_s`."""

    def __init__(
        self, model_dir: str, vocab_size: int, eos_ids: list[int], workers: int, deadline_s: float
    ):
        self.args = [model_dir, str(vocab_size), ",".join(map(str, eos_ids))]
        self.workers = workers
        self.deadline_s = deadline_s
        self.killed = 0  # compiles stopped at their deadline (or children that died)
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._count = 0  # workers running or starting
        self._lock = threading.Lock()
        self._closed = False

    def check(self, grammar: str) -> str | None:
        """Compile `grammar` in a worker: its error text, or None when it compiles."""
        with self._lock:  # all workers start with the first check
            while self._count < self.workers:
                self._count += 1
                self._replace()
        try:
            w = self._idle.get(timeout=self.deadline_s + START_TIMEOUT_S)
        except queue.Empty:
            raise GrammarWorkersBusy from None
        try:
            error = w.ask(grammar, self.deadline_s)
        except (GrammarTimeout, OSError, ValueError, KeyError):  # past the deadline, or died
            died = w.proc.poll() is not None
            w.kill()
            self.killed += 1
            self._replace()
            if died:
                return "the compile's worker died (out of memory?)"
            raise GrammarTimeout from None
        self._idle.put(w)
        return error

    def _replace(self) -> None:
        threading.Thread(target=self._start_one, name="grammar-worker-start", daemon=True).start()

    def _start_one(self) -> None:
        cmd = [sys.executable, "-m", "pdserve.engine.grammar_check", *self.args]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = _read_line(proc, START_TIMEOUT_S)
        if line is None or not json.loads(line).get("ready") or self._closed:
            if not self._closed:
                logger.error("a grammar worker did not start within %g s", START_TIMEOUT_S)
            _Worker(proc).kill()
            with self._lock:
                self._count -= 1
            return
        self._idle.put(_Worker(proc))

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


def _serve(model_dir: str, vocab_size: int, eos_ids: list[int]) -> None:
    """The child: compile each grammar as the engine would, answer on stdout."""
    import ctypes

    from pdserve.common.errors import InvalidRequestError
    from pdserve.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(model_dir, vocab_size, eos_ids)
    compiler._llg_tokenizer()
    mask = (ctypes.c_int32 * ((vocab_size + 31) // 32))()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            matcher = compiler._compile(json.loads(line)["grammar"])
            matcher.unsafe_compute_mask_ptr(ctypes.addressof(mask), ctypes.sizeof(mask))
            error = matcher.get_error() if matcher.is_error() else None
        except (InvalidRequestError, ValueError, TypeError, KeyError) as e:
            error = str(e)
        print(json.dumps({"error": error}), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "WARNING"))
    _serve(sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",") if x])

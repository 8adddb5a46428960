"""Graceful drain on SIGTERM (api/drain.py), on a real node process: streams in flight run
to their end, a new request gets a 503 `draining` OpenAI-style body meanwhile, and the
process then exits by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.servers import ROOT, descendants, free_port, kill_server, start_server, wait_healthy

NODE_ARGS = ["--num-threads", "1", "--log-level", "warning", "--num-blocks", "256"]
NODE_ARGS += ["--max-model-len", "512", "--drain-timeout-s", "120"]


@pytest.mark.parametrize("to", ["node", "every_process"])
def test_sigterm_finishes_in_flight_answers_503_then_exits(tiny_llama_dir, to):
    """SIGTERM to the node, or to every process of it at once (what a launcher's process
    group signal or systemd's cgroup stop does): the engine ignores it, the node drains."""
    url, proc = start_server(["--model", tiny_llama_dir, *NODE_ARGS])
    try:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        ends: list[str] = []
        errors: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
                last = ""
                for line in r.iter_lines():
                    last = line or last
                    if '"error"' in line:
                        errors.append(line)
                ends.append(last)

        engines = descendants(proc.pid)
        for pid in engines:  # requests reach the server but wait: in flight while it drains
            os.kill(pid, signal.SIGSTOP)
        try:
            threads = [threading.Thread(target=stream) for _ in range(4)]
            for t in threads:
                t.start()
            time.sleep(2.0)
            for pid in [proc.pid, *(engines if to == "every_process" else [])]:
                os.kill(pid, signal.SIGTERM)
            time.sleep(0.5)
            r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            assert httpx.get(f"{url}/health", timeout=30).status_code == 503
            assert proc.poll() is None  # still waiting for its streams
        finally:
            for pid in engines:
                os.kill(pid, signal.SIGCONT)
        for t in threads:
            t.join(300)
        assert ends == ["data: [DONE]"] * 4  # every stream in flight ran to its end
        assert errors == []  # ... normally (not the error event of a dead engine)
        # then it exits on its own (uvicorn re-raises the SIGTERM it held back)
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        kill_server(proc)


HUNG_STOP = """
import asyncio, sys
from contextlib import asynccontextmanager
from fastapi import FastAPI
from pdserve.api.drain import serve
from pdserve.common.stack_dump import install_on_sigusr1

@asynccontextmanager
async def lifespan(app):
    yield
    await asyncio.Event().wait()  # a shutdown step that never ends (a client's close, ...)

install_on_sigusr1()
app = FastAPI(lifespan=lifespan)
app.get("/health")(lambda: "ok")
serve(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
      drain_timeout_s=0.5, exit_margin_s=1.5, exit_code=lambda: 7)
"""


def test_a_stop_that_hangs_ends_at_its_deadline_with_every_stack_in_the_log():
    """api/drain.py `exit_by`: SIGTERM, then a shutdown step that never returns; the process
    still ends, drain + margin after the signal, with the caller's exit code, and its log
    shows where it hung."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", HUNG_STOP, str(port)], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=60, poll_s=0.1)
        proc.send_signal(signal.SIGUSR1)  # a look at a live process: it goes on serving
        time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        took = time.monotonic() - t0
        log = proc.stderr.read()
    finally:
        kill_server(proc)
    assert code == 7, log
    assert 2.0 <= took < 10, took  # 0.5 s drain + 1.5 s margin, not forever
    assert "then a forced exit (code 7)" in log
    assert "in lifespan" in log  # the hung frame, in the stack dump
    usr1, forced = log.split("still running")
    assert "Thread 0x" in usr1 and "asyncio task" in usr1  # SIGUSR1's dump, before

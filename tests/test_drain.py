"""Graceful drain on SIGTERM (api/drain.py), on a real node process: streams in flight run
to their end, a new request gets a 503 `draining` OpenAI-style body meanwhile, and the
process then exits by itself."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.servers import descendants, kill_server, start_server

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

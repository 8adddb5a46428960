"""The router's per-client concurrency limit (`--max-concurrent-per-key`): with that many
generation requests in flight, the next one gets a 429 OpenAI-style error at once; slots
free as requests end, whatever way they end (real node, real router, real HTTP)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.servers import kill_server, start_server

NODE_ARGS = ["--num-threads", "1", "--log-level", "warning", "--num-blocks", "64"]
BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def node(tiny_llama_dir):
    url, proc = start_server(["--model", tiny_llama_dir, *NODE_ARGS])
    yield url, proc
    kill_server(proc)


def test_concurrent_requests_over_the_limit_get_429(node, tiny_llama_dir):
    node_url, node_proc = node
    router, proc = start_server(
        ["--model", tiny_llama_dir, "--decode", node_url, "--max-concurrent-per-key", "2",
         "--health-interval-s", "60", "--log-level", "warning"],
        command="router",
    )  # fmt: skip
    try:
        results: list[int] = []

        def held() -> None:
            r = httpx.post(f"{router}/v1/completions", json=BODY, timeout=120)
            results.append(r.status_code)

        os.kill(node_proc.pid, signal.SIGSTOP)  # requests that reach the node now wait
        try:
            threads = [threading.Thread(target=held) for _ in range(2)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            deadline = time.monotonic() + 30
            while True:  # until both are in flight at the router
                try:
                    r = httpx.post(f"{router}/v1/completions", json=BODY, timeout=5)
                except httpx.ReadTimeout:  # admitted: the held ones were not in yet
                    continue
                if r.status_code == 429:
                    break
                assert time.monotonic() < deadline, "no 429 while 2 requests were in flight"
                time.sleep(0.2)
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and "2 concurrent" in err["message"]
        finally:
            os.kill(node_proc.pid, signal.SIGCONT)
        for t in threads:
            t.join(120)
        assert results == [200, 200]
        # the slots are free again
        for _ in range(3):
            r = httpx.post(f"{router}/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 200, r.text
    finally:
        kill_server(proc)

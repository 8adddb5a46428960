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

from tests.servers import descendants, kill_server, start_server

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


def test_stuck_engine_gets_no_new_requests_until_it_advances(node, tiny_llama_dir):
    """Issue 29, a stuck engine at the router: the decode node's HTTP process answers
    while its EngineCore is frozen (SIGSTOP) holding a request. Its /v1/node step count
    stops while it is busy; after `--engine-stuck-after-s` the router sends it no new
    requests (503 `no_nodes` at once, not a request left hanging); once the engine runs
    again (SIGCONT) its steps advance and it serves again, the held request included."""
    node_url, node_proc = node
    router, proc = start_server(
        ["--model", tiny_llama_dir, "--decode", node_url, "--health-interval-s", "0.3",
         "--engine-stuck-after-s", "1.5", "--log-level", "warning"],
        command="router",
    )  # fmt: skip
    (engine,) = [p for p in descendants(node_proc.pid) if b"spawn_main" in cmdline(p)]
    held: list[httpx.Response] = []
    reader = threading.Thread(
        target=lambda: held.append(httpx.post(f"{router}/v1/completions", json=BODY, timeout=60))
    )
    try:
        assert httpx.post(f"{router}/v1/completions", json=BODY, timeout=60).status_code == 200
        os.kill(engine, signal.SIGSTOP)
        t0 = time.monotonic()
        reader.start()  # the engine now holds a request it cannot serve
        status, r = None, None
        while status != 503 and time.monotonic() - t0 < 20:
            time.sleep(0.2)
            try:
                r = httpx.post(f"{router}/v1/completions", json=BODY, timeout=1.0)
                status = r.status_code
            except httpx.TimeoutException:  # sent before it was found stuck: it waits
                status = None
        stuck_s = time.monotonic() - t0
        assert status == 503 and r.json()["error"]["code"] == "no_nodes", (status, stuck_s)
        (summary,) = httpx.get(f"{router}/cluster", timeout=5).json()["nodes"]
        assert summary["engine_stuck"] is True
        os.kill(engine, signal.SIGCONT)
        t1 = time.monotonic()
        reader.join(60)
        assert held[0].status_code == 200, held[0].text
        while status != 200 and time.monotonic() - t1 < 20:
            status = httpx.post(f"{router}/v1/completions", json=BODY, timeout=20).status_code
            time.sleep(0.05)
        assert status == 200
        print(f"\nstuck engine: refused after {stuck_s:.1f} s, serving "
              f"{time.monotonic() - t1:.1f} s after SIGCONT")  # fmt: skip
    finally:
        os.kill(engine, signal.SIGCONT)
        kill_server(proc)


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""

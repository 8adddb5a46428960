"""A node whose EngineCore dies (node/api_server.py `_exit_when_engine_dies`), on a real
`pdserve serve` process: what reaches it meanwhile gets a clear `engine_dead` answer, and
the node exits with code 3 by its deadline for its supervisor to restart it.

A Redis that accepts and never answers keeps the node leaving the registry for a while
(`ClusterAgent.stop`, bounded by LEAVE_TIMEOUT_S) before it drains: the window where a
request still reaches a node with a dead engine, widened on purpose."""

from __future__ import annotations

import os
import signal
import time

import httpx

from pdserve.api.drain import EXIT_MARGIN_S
from pdserve.node.api_server import EXIT_ENGINE_DEAD
from pdserve.node.cluster_agent import LEAVE_TIMEOUT_S
from tests.servers import engine_core_of, kill_server, start_server

DRAIN_S = 2
NODE_ARGS = ["--num-threads", "1", "--log-level", "warning", "--num-blocks", "64"]
NODE_ARGS += ["--max-model-len", "256", "--drain-timeout-s", str(DRAIN_S)]


def test_dead_engine_every_request_gets_engine_dead_then_the_node_exits_3(
    tiny_llama_dir, hung_redis_url
):
    url, proc = start_server(["--model", tiny_llama_dir, *NODE_ARGS, "--redis-url", hung_redis_url])
    try:
        os.kill(engine_core_of(proc.pid), signal.SIGKILL)
        t_kill = time.monotonic()
        while True:  # the node notices (it polls its EngineCore every 0.2 s)
            r = httpx.get(f"{url}/health", timeout=10)
            if r.status_code == 503:
                break
            assert time.monotonic() - t_kill < 10, "the node never noticed its engine died"
            time.sleep(0.05)
        assert r.json()["error"]["code"] == "engine_dead"  # still leaving: not draining yet

        body = {"prompt": [5, 6, 7], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as s:
            assert s.status_code == 200
            lines = [line for line in s.iter_lines() if line]
        # a terminal error event and the end of the stream, not a cut connection
        assert any('"code":"engine_dead"' in line for line in lines), lines
        assert lines[-1] == "data: [DONE]", lines

        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"

        code = proc.wait(LEAVE_TIMEOUT_S + DRAIN_S + EXIT_MARGIN_S + 10)
        assert code == EXIT_ENGINE_DEAD
    finally:
        kill_server(proc)

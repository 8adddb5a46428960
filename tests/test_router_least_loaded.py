"""`least_loaded` (power of two choices) through a real router, real Redis and real HTTP.

Three light fake decode nodes (benchmarks/_fake_fleet.py: they register and heartbeat like
real nodes) report 0, 6 and 12 running requests. Power of two choices compares two random
candidates and takes the less loaded: the heaviest node is never the lighter of a pair, so
it must get nothing; the lightest wins every pair it is drawn in (2/3 of the draws), the
middle one only the pairs without the lightest (1/3). Counts come from the nodes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from tests.servers import ROOT, kill_server, start_server

LOADS = [0, 6, 12]
N = 90


def _fleet(redis_url: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "benchmarks._fake_fleet", "--redis-url", redis_url,
           "--prefill", "0", "--decode", str(len(LOADS)),
           "--decode-load", ",".join(map(str, LOADS))]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT)


def _nodes(router: str) -> list[dict]:
    return httpx.get(f"{router}/cluster", timeout=10).json()["nodes"]


def test_least_loaded_prefers_the_node_reporting_less_load(redis_server, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1000}))
    fleet = _fleet(redis_server.url)
    router = None
    try:
        url, router = start_server(
            ["--model", str(model), "--served-model-name", "fake", "--redis-url",
             redis_server.url, "--decode-policy", "least_loaded", "--prefill-policy",
             "round_robin", "--log-level", "warning"],
            command="router",
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while True:  # every node registered, with its pinned load visible to the router
            nodes = _nodes(url)
            pinned = {n["url"]: n["load"]["running"] or 0 for n in nodes if n["in_registry"]}
            if sorted(pinned.values()) == LOADS:
                break
            assert time.monotonic() < deadline, f"fleet not registered: {nodes}"
            time.sleep(0.2)
        for i in range(N):
            body = {"model": "fake", "prompt": [i % 1000] * 8, "max_tokens": 1}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        served = {}
        for node_url, load in pinned.items():  # keyed by the load seen before any request
            stats = httpx.get(f"{node_url}/fake/stats", timeout=10).json()
            served[load] = stats["served"]
        assert sum(served.values()) == N
        assert served[12] == 0, served  # never the lighter of two
        assert served[0] > served[6] > 0, served  # wins 2/3 of the draws, the middle 1/3
    finally:
        if router is not None:
            kill_server(router)
        fleet.kill()
        fleet.wait(30)

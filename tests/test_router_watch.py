"""The router's lean path through a real router, real Redis (kv_aware) and a light fake
decode node (benchmarks/_fake_fleet.py):

- with a prefill that would take the node 80 s, a client that hangs up before the first
  token (streamed) or before the answer (JSON) ends the attempt: the router's in-flight
  accounting returns to zero, and the node sees its stream closed (router/client_watch.py);
- a request refused by a check that runs while its KV index lookup is out (the lookup is
  sent first, router/selector.py `begin`) gets its 400, and every later lookup still gets
  its own reply: a held prompt is predicted to hit all of its blocks each time;
- a body the lean path does not take (chunked: no Content-Length) is served by the
  FastAPI route and streams the same events.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import pytest

from tests.servers import ROOT, kill_server, start_server


def _wait(what: str, cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@contextmanager
def _cluster(redis_url: str, model_dir, prefill_tok_s: float):
    """(router url, fake decode node url): a kv_aware router on Redis, one fake node."""
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1000}))
    fleet = subprocess.Popen(
        [sys.executable, "-m", "benchmarks._fake_fleet", "--redis-url", redis_url,
         "--prefill", "0", "--decode", "1", "--prefill-tok-s", str(prefill_tok_s)],
        cwd=ROOT,
    )  # fmt: skip
    router = None
    try:
        url, router = start_server(
            ["--model", str(model_dir), "--served-model-name", "fake", "--redis-url",
             redis_url, "--log-level", "warning"],
            command="router",
        )  # fmt: skip
        (node,) = httpx.get(f"{url}/cluster", timeout=10).json()["nodes"]
        yield url, node["url"]
    finally:
        if router is not None:
            kill_server(router)
        fleet.kill()
        fleet.wait(30)


def _running(node: str) -> int:
    return httpx.get(f"{node}/v1/node", timeout=10).json()["running"]


def _router_inflight(router: str) -> int:
    (n,) = httpx.get(f"{router}/cluster", timeout=10).json()["nodes"]
    return n["load"]["router_inflight"]


@pytest.mark.parametrize("stream", [True, False])
def test_client_gone_before_the_first_token_stops_the_request(redis_server, tmp_path, stream):
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 2, "stream": stream}
    # 4 tokens at 0.05 tokens/s: the node would answer after 80 s
    with _cluster(redis_server.url, tmp_path / "model", 0.05) as (router, node):

        async def leave_while_the_node_works() -> None:
            async with httpx.AsyncClient(timeout=120) as c:
                task = asyncio.create_task(c.post(f"{router}/v1/completions", json=body))
                await asyncio.to_thread(_wait, "node has it", lambda: _running(node) == 1)
                assert _router_inflight(router) == 1
                task.cancel()  # hang up

        asyncio.run(leave_while_the_node_works())
        _wait("router released it", lambda: _router_inflight(router) == 0, timeout_s=30)
        if stream:  # the fake node notices a closed stream (not a JSON request's close)
            _wait("node ended it", lambda: _running(node) == 0, timeout_s=30)


def test_refused_request_with_its_lookup_out_leaves_later_lookups_in_step(redis_server, tmp_path):
    held, other = list(range(100, 164)), list(range(200, 264))  # 4 blocks of 16 each
    with _cluster(redis_server.url, tmp_path / "model", 50_000.0) as (url, _):

        def predicted() -> float:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            (line,) = [x for x in text.splitlines()
                       if x.startswith("pdserve_router_predicted_prefix_hit_tokens_total")]  # fmt: skip
            return float(line.split()[-1])

        def post(prompt: list[int], **extra) -> httpx.Response:
            body = {"prompt": prompt, "max_tokens": 2, **extra}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=60)

        assert post(held).status_code == 200
        assert predicted() == 0
        _wait("the node's blocks indexed", lambda: post(held).status_code == 200 and predicted())
        for _ in range(5):
            before = predicted()
            # refused by a sampling check that runs while its lookup is out
            r = post(other, temperature=-1)
            assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
            assert post(held).status_code == 200
            assert predicted() - before == 63  # its own reply: 4 blocks, 1 token to compute


def test_a_chunked_body_takes_the_fastapi_route_and_streams_the_same(redis_server, tmp_path):
    body = json.dumps({"prompt": [1], "max_tokens": 2, "stream": True}).encode()
    headers = {"Content-Type": "application/json"}
    with _cluster(redis_server.url, tmp_path / "model", 50_000.0) as (router, _):
        with httpx.Client(timeout=120) as c:
            lean = c.post(f"{router}/v1/completions", content=body, headers=headers)
            chunked = c.post(f"{router}/v1/completions", content=iter([body[:5], body[5:]]),
                             headers=headers)  # fmt: skip
    for r in (lean, chunked):
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == ["x", "x"]

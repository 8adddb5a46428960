"""The router in front of real nodes (tiny random Llama, real HTTP, real processes).

Static nodes, no Redis: the router relays completions (JSON and SSE) token for token as the
node answers them, rejects bad input with the node's own error bodies without reaching a
node, retries on another node when the first cannot serve, and stops using a dead node.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.servers import ROOT, engine_state, kill_server, start_server, wait_idle

NODE_ARGS = ["--num-threads", "1", "--log-level", "warning", "--num-blocks", "64"]


@pytest.fixture(scope="module")
def node(tiny_llama_dir):
    url, proc = start_server(["--model", tiny_llama_dir, *NODE_ARGS])
    yield url, proc
    kill_server(proc)


@pytest.fixture(scope="module")
def router(node, tiny_llama_dir):
    url, proc = start_server(
        [
            "--model", tiny_llama_dir,
            "--decode", node[0],
            "--decode-policy", "round_robin",
            "--health-interval-s", "60",  # probes only at start: the node may be paused below
            "--log-level", "warning",
        ],
        command="router",
    )  # fmt: skip
    yield url
    kill_server(proc)


def completion(url: str, **body) -> httpx.Response:
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def stream_text(url: str, path: str, body: dict) -> tuple[list[str], bytes]:
    """The `data:` events of a streamed answer, and the raw bytes."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        raw = r.read()
    return [e for e in raw.decode().split("\n\n") if e], raw


def test_router_imports_no_engine_torch_or_kernels():
    code = (
        "import sys, pdserve.router.app, pdserve.router.cli, pdserve.router.tokenizer, pdserve.router.selector\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'engine', 'kernels', 'transformers', 'prefill', 'decode', 'node'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_completions_equal_the_node(node, router):
    prompt = [5, 17, 99, 3, 250, 7, 7, 31, 400, 12]
    direct = completion(node[0], prompt=prompt, logprobs=0)
    routed = completion(router, prompt=prompt, logprobs=0)
    assert direct.status_code == routed.status_code == 200, routed.text
    d, r = direct.json(), routed.json()
    assert r["choices"] == d["choices"]
    assert r["usage"]["completion_tokens"] == 8
    assert routed.headers["x-request-id"]


def test_streaming_relay_equals_the_node(node, router):
    body = {"prompt": [9, 8, 7, 6, 5, 4], "max_tokens": 6, "temperature": 0, "stream": True,
            "logprobs": 0, "ignore_eos": True}  # fmt: skip
    direct, _ = stream_text(node[0], "/v1/completions", body)
    routed, _ = stream_text(router, "/v1/completions", body)
    assert routed[-1] == direct[-1] == "data: [DONE]"

    def tokens(events: list[str]) -> list[str]:
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        return [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]

    assert tokens(routed) == tokens(direct) and len(tokens(routed)) == 6
    # usage is relayed only when asked for
    with_usage, _ = stream_text(
        router, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    last = json.loads(with_usage[-2][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6


BAD_BODIES = [
    {"prompt": [1, 2, 3], "n": 17},
    {"prompt": [1, 2, 3], "model": "no-such-model"},
    {"prompt": []},
    {"prompt": "text needs a tokenizer"},
    {"prompt": [1, 2, 5000]},  # outside the vocabulary
    {"prompt": list(range(1, 600))},  # longer than the context
    {"prompt": [1, 2, 3], "max_tokens": 100_000},
    {"prompt": [1, 2, 3], "max_tokens": 0},  # only with echo
    {"prompt": [1, 2, 3], "temperature": "hot"},
    {"prompt": [1, 2, 3], "frobnicate": 1},  # unknown field
    {"prompt": [1, 2, 3], "logit_bias": {"x": 1}},
    {"prompt": [1, 2, 3], "logit_bias": {"5000": 1}},  # outside the vocabulary
    {"prompt": [1, 2, 3], "stop_token_ids": [5000]},
    {"prompt": [1, 2, 3], "temperature": float("nan")},
    {"prompt": [1, 2, 3], "temperature": -1},
    {"prompt": [1, 2, 3], "top_p": 0},
    {"prompt": [1, 2, 3], "seed": 2**70},
    {"prompt": [1, 2, 3], "stop": [""]},
    {"prompt": [1, 2, 3], "max_tokens": 1.5},
    {"prompt": [1, 2, 3], "min_tokens": 9, "max_tokens": 4},
    {"prompt": [1, 2, 3], "presence_penalty": 3},
]


def post_raw(url: str, body: dict, timeout: float) -> httpx.Response:
    """POST `body` as JSON that may hold NaN (httpx's own encoder refuses it)."""
    return httpx.post(
        f"{url}/v1/completions",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=timeout,
    )


RAW_BAD = [
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "application/json"),
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "application/json"),
    (b'{"prompt": [1], "temperature": NaN}', "application/json"),
    (b'{"prompt": [1], "temperature": 1e999}', "application/json"),
    (b'{"prompt": [1], "max_tokens": 2}', "text/plain"),
    (b'{"prompt": [1], "max_tokens": 2', None),
    (b"", "application/json"),
    (b'["prompt"]', "application/json"),
]


def post_bytes(base: str, content: bytes, content_type: str | None, timeout: float):
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(f"{base}/v1/completions", content=content, headers=headers, timeout=timeout)


def test_bad_input_gets_the_node_error_bodies_without_touching_a_node(node, router):
    url, proc = node
    # Pause the node: a request that reached it would hang, not answer.
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        routed = [post_raw(router, b, 10) for b in BAD_BODIES]
        steer = post_raw(router, {"prompt": [1], "kv_transfer_params": {"prefill_node": "x"}}, 10)
        chat = httpx.post(
            f"{router}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        bad_json = httpx.post(
            f"{router}/v1/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
            timeout=10,
        )
        raw_routed = [post_bytes(router, b, t, 10) for b, t in RAW_BAD]
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    direct = [post_raw(url, b, 60) for b in BAD_BODIES]
    for body, r, d in zip(BAD_BODIES, routed, direct):
        assert 400 <= d.status_code < 500, (body, d.text)
        assert (r.status_code, r.json()) == (d.status_code, d.json()), body
    d_chat = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert (chat.status_code, chat.json()) == (d_chat.status_code, d_chat.json())
    d_json = httpx.post(
        f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert (bad_json.status_code, bad_json.json()) == (d_json.status_code, d_json.json())
    # bodies the router's lean path leaves to FastAPI (router/fast_path.py): same answers
    for (b, t), r in zip(RAW_BAD, raw_routed):
        d = post_bytes(url, b, t, 60)
        assert 400 <= d.status_code < 500, (b[:40], t, d.text)
        assert (r.status_code, r.json()) == (d.status_code, d.json()), (b[:40], t)
    # Clients never choose the prefill node: the router says so.
    assert steer.status_code == 400
    assert steer.json()["error"]["param"] == "kv_transfer_params.prefill_node"


def test_api_key_and_cluster_view(node, tiny_llama_dir):
    url, proc = start_server(
        ["--model", tiny_llama_dir, "--decode", node[0], "--api-key", "s3cret",
         "--log-level", "warning"],
        command="router",
    )  # fmt: skip
    try:
        r = completion(url, prompt=[1, 2, 3])
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": [1, 2, 3], "max_tokens": 2},
            headers={"Authorization": "Bearer s3cret"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        key = {"Authorization": "Bearer s3cret"}
        for path in ("/cluster", "/metrics"):  # they show the cluster: the key is wanted
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 401, path
        view = httpx.get(f"{url}/cluster", headers=key, timeout=10).json()
        (n,) = view["nodes"]
        assert n["url"] == node[0] and n["role"] == "colocated" and n["healthy"]
        assert n["block_size"] == 16 and n["epoch"] > 0
        metrics = httpx.get(f"{url}/metrics", headers=key, timeout=10).text
        assert 'pdserve_router_requests_total{route="completions",status="401"} 1.0' in metrics
        assert 'pdserve_router_requests_total{route="completions",status="200"} 1.0' in metrics
    finally:
        kill_server(proc)


def test_client_disconnect_through_the_router_leaves_nothing_behind(node, router):
    url, _ = node
    body = {"prompt": [4, 5, 6, 7], "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def leave_early(stream: bool) -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            if stream:
                async with c.stream(
                    "POST", f"{router}/v1/completions", json={**body, "stream": True}
                ) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_bytes():
                        break  # one chunk, then hang up
            else:  # hang up while the node generates: a fast engine may finish 400 tokens
                # between two polls, then that try did not test anything: try again
                for _ in range(10):
                    task = asyncio.create_task(c.post(f"{router}/v1/completions", json=body))
                    deadline = time.monotonic() + 30
                    while engine_state(url)["num_running"] == 0 and not task.done():
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.005)
                    if not task.done():
                        task.cancel()
                        return
                    assert (await task).status_code == 200
                raise AssertionError("the request never seen running in 10 tries")

    for stream in (True, False):
        asyncio.run(leave_early(stream))
        wait_idle(url, timeout_s=30)  # nothing running, no block held, integrity holds

        def released() -> bool:  # the router's in-flight accounting went back to zero
            (n,) = httpx.get(f"{router}/cluster", timeout=10).json()["nodes"]
            return n["load"]["router_inflight"] == 0

        deadline = time.monotonic() + 30
        while not released():
            assert time.monotonic() < deadline
            time.sleep(0.1)

"""Live nodes (`pdserve serve --kv-store lmcache`) sharing prompt KV through one Redis.

Node A computes a prompt and saves it; node B (another process, its own LMCache tier)
loads it and computes only the tail; B restarted still finds it; with Redis gone the
nodes keep answering by computing locally. Texts are compared between nodes: the first
computation of a prompt uses no store, so equal texts mean the loaded KV changed nothing.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.servers import alive, descendants, engine_state, kill_server, start_server, wait_idle

pytestmark = pytest.mark.slow
pytest.importorskip("lmcache")

MODEL = "smollm2-135m-instruct"
BS, CHUNK = 16, 32
PROMPT = (
    "The history of the bicycle is a story of many inventors. In 1817 Karl von Drais built "
    "a two-wheeled running machine that riders pushed along with their feet. Decades later, "
    "pedals were attached to the front wheel, and by the 1880s the safety bicycle, with a "
    "chain drive and two wheels of equal size, had taken its modern shape. Summarise this:"
)


def node_args(redis_url: str, as_backend: bool = False) -> list[str]:
    """`as_backend`: the store named as a composed backend (`--kv-backend`), not `--kv-store`."""
    store = (["--kv-backend", f"lmcache:load,save:{redis_url}"] if as_backend
             else ["--kv-store", "lmcache", "--kv-store-url", redis_url])  # fmt: skip
    return [
        "--model", MODEL, "--kv-cache-bytes", str(64 << 20), "--num-threads", "1",
        "--block-size", str(BS), "--log-level", "warning", *store,
        "--kv-store-chunk-size", str(CHUNK), "--kv-store-local-bytes", str(64 << 20),
        "--kv-store-load-timeout", "30", "--kv-store-retry-after", "0",
    ]  # fmt: skip


def complete(url: str, prompt: str) -> tuple[str, int, int]:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return body["choices"][0]["text"], usage["prompt_tokens"], cached


def stream_ids(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The token ids of a greedy streamed completion (the router's `ids` comments)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    out = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300,
                      headers={"X-Pdserve-Token-Ids": "1"}) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(": ids "):
                out += map(int, line[6:].split()[3:])
    return out


def wait_saved(url: str, saves: int, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while (stats := wait_idle(url))["kv_store_saves"] < saves:
        assert stats["kv_store_save_failures"] == 0, stats
        assert time.monotonic() < deadline, f"prompt not saved: {stats}"
        time.sleep(0.2)
    return stats


def test_nodes_share_prefixes_through_redis(redis_server):
    url_a, proc_a = start_server(node_args(redis_server.url))
    procs = [proc_a]
    try:
        text_a, n, cached = complete(url_a, PROMPT)
        assert cached == 0
        wait_saved(url_a, 1)
        expected_hit = (n - 1) // BS * BS  # every whole block but the one computing the last token

        url_b, proc_b = start_server(node_args(redis_server.url))
        procs.append(proc_b)
        text_b, _, cached_b = complete(url_b, PROMPT)
        stats_b = wait_idle(url_b)
        assert text_b == text_a
        assert cached_b == expected_hit
        assert stats_b["kv_store_hit_tokens"] == expected_hit
        # loaded whole: saved all the same, the store answering at once that it holds it all
        assert wait_saved(url_b, 1)["kv_store_saves"] == 1

        # A running request's generated tokens are saved as they fill whole chunks: B,
        # given A's prompt + 60 of its generated tokens, loads past the prompt from the
        # store (it never computed those tokens) and goes on as A did, token for token.
        ids = httpx.post(f"{url_a}/tokenize", json={"prompt": PROMPT}, timeout=30).json()
        prompt_ids = ids["tokens"]
        saves_a = wait_idle(url_a)["kv_store_saves"]
        gen = stream_ids(url_a, prompt_ids, 72)
        assert len(gen) == 72
        # its prompt (the store holds it: answered at once) and at least one whole chunk
        # past the prompt as it filled (CHUNK = 32 of the 72 tokens)
        assert wait_saved(url_a, saves_a + 2)["kv_store_saves"] >= saves_a + 2
        hits_b = wait_idle(url_b)["kv_store_hit_tokens"]
        assert stream_ids(url_b, prompt_ids + gen[:60], 4) == gen[60:64]
        # B held the prompt and its own 12 tokens at most: a block more came from the store
        loaded = wait_idle(url_b)["kv_store_hit_tokens"] - hits_b
        assert loaded >= BS, loaded

        # Shutdown with the LMCache backend is bounded, and leaves no process behind.
        kids = descendants(proc_b.pid)
        t = time.monotonic()
        proc_b.send_signal(signal.SIGTERM)
        assert proc_b.wait(30) in (0, -signal.SIGTERM)
        while any(alive(p) for p in kids) and time.monotonic() - t < 30:
            time.sleep(0.05)
        shutdown_s = time.monotonic() - t
        assert not [p for p in kids if alive(p)]
        assert shutdown_s < 10.0, f"node shutdown took {shutdown_s:.1f} s"

        # A restarted node (empty cache, empty LMCache tier) still finds the prefix (its
        # store given as a composed backend this time: the same behaviour).
        url_b2, proc_b2 = start_server(node_args(redis_server.url, as_backend=True))
        procs.append(proc_b2)
        text_b2, _, cached_b2 = complete(url_b2, PROMPT)
        assert text_b2 == text_a and cached_b2 == expected_hit
        assert engine_state(url_b2)["kv_store_hit_tokens"] == expected_hit

        # Redis gone: a new prompt still completes (computed locally), and it is counted.
        redis_server.stop()
        text_c, _, cached_c = complete(url_b2, "Another prompt entirely, " + PROMPT)
        assert text_c and cached_c == 0
        stats = wait_idle(url_b2)
        assert stats["kv_store_load_failures"] >= 1
        metrics = httpx.get(f"{url_b2}/metrics", timeout=30).text
        assert "pdserve_kv_store_load_failures_total" in metrics
        assert "pdserve_kv_store_fallbacks_total 0.0" in metrics  # one backend: none to pass to
    finally:
        for p in procs:
            kill_server(p)

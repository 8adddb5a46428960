"""`pdserve bench serve` against live endpoints, and `pdserve bench kv` across processes.

A real pdserve node (tiny random model), a real misbehaving HTTP server (HTTP 500s, streams
cut short), a port nobody listens on, and two `bench kv` processes that share only an
address.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import threading

import pytest

from pdserve.cli import main as pdserve_main
from tests.servers import ROOT, free_port, kill_server, start_server

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LMCACHE = importlib.util.find_spec("lmcache") is not None


def _bench(tmp_path, url: str, *extra: str) -> dict:
    out = tmp_path / "r.json"
    pdserve_main(["bench", "serve", "--base-url", url, "--out", str(out), "--no-progress",
                  "--request-timeout", "120", *extra])  # fmt: skip
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def node(tiny_llama_dir):
    url, proc = start_server(["--model", tiny_llama_dir, "--log-level", "warning"])
    yield url
    kill_server(proc)


def test_short_run_against_a_node(node, tmp_path):
    report = _bench(
        tmp_path, node, "--num-prompts", "6", "--input-len", "24", "--output-len", "8",
        "--range-ratio", "0.5", "--request-rate", "20", "inf", "--max-concurrency", "4",
        "--goodput", "ttft:60000", "tpot:60000", "--extra-body", '{"logprobs": 0}',
    )  # fmt: skip
    assert report["config"]["num_prompts"] == 6 and report["versions"]["python"]
    assert report["server"]["/v1/models"]["data"][0]["id"] == report["config"]["model"]
    assert len(report["runs"]) == 2
    for run in report["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"]) == (6, 0), m["failure_examples"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(m[key]) >= {"mean", "median", "std", "p50", "p90", "p99"}
            assert m[key]["mean"] is not None and m[key]["mean"] > 0
        assert m["goodput"]["good_requests"] == 6
        assert m["max_concurrent_requests"] <= 4
        reqs = run["requests"]
        for r in reqs:
            assert r["ok"] and r["e2e"] >= r["ttft"] > 0
            # ignore_eos: every token asked for arrived (a slow reader may get two in one
            # chunk: counted from each chunk's logprobs), as usage says
            assert r["output_tokens"] == r["max_tokens"] == sum(r["chunk_tokens"])
            assert len(r["chunk_times"]) == len(r["chunk_tokens"]) <= r["max_tokens"]
            assert r["output_tokens_source"] == "usage"
        assert m["total_output_tokens"] == sum(r["max_tokens"] for r in reqs)
        assert m["total_input_tokens"] == sum(r["prompt_len"] for r in reqs)
        # the node's own counters moved by exactly what the benchmark received
        moved = run["server_counters"]["delta"][node + "/metrics"]
        assert moved["pdserve_generation_tokens_total"] == m["total_output_tokens"]
        assert moved['pdserve_requests_total{finish_reason="length"}'] == 6
        # each rate draws its own prompts: none of the second run's are cached from the first
        assert moved.get("pdserve_prefix_cache_hits_total", 0) == 0
        assert moved["pdserve_prefix_cache_queries_total"] > 0
    assert [run["dataset_seed"] for run in report["runs"]] == [0, 1]
    stem = tmp_path / "r"
    for suffix in ("_cdf.png", "_sweep.png"):
        assert (stem.parent / (stem.name + suffix)).read_bytes()[:8] == PNG_MAGIC


def test_ttft_stages_from_a_node(node, tmp_path):
    report = _bench(tmp_path, node, "--num-prompts", "3", "--input-len", "40", "--output-len",
                    "3", "--extra-body", '{"logprobs": 0}', "--no-plots")  # fmt: skip
    for r in report["runs"][0]["requests"]:
        t = r["server_timings"]
        assert t["role"] == "colocated" and list(t["stages"]) == ["frontend", "queue", "prefill"]
        assert all(v >= 0 for v in t["stages"].values())
        assert sum(t["stages"].values()) == pytest.approx(t["ttft_s"])
        assert r["ttft"] >= t["ttft_s"]  # the client sees the server's TTFT and more
    stages = report["runs"][0]["metrics"]["ttft_stages_ms"]
    assert set(stages) == {"frontend", "queue", "prefill", "client_overhead"}


@pytest.fixture(scope="module")
def pd_pair(tiny_llama_dir):
    ctl = f"tcp://127.0.0.1:{free_port()}"
    common = ["--model", tiny_llama_dir, "--log-level", "warning"]
    p_url, p_proc = start_server([*common, "--role", "prefill", "--kv-control", ctl])
    d_url, d_proc = start_server([*common, "--role", "decode", "--prefill-node", ctl])
    yield p_url, d_url
    kill_server(d_proc)
    kill_server(p_proc)


def test_pd_ttft_breakdown_and_counters_of_both_nodes(pd_pair, tmp_path):
    p_url, d_url = pd_pair
    report = _bench(
        tmp_path, d_url, "--num-prompts", "4", "--input-len", "64", "--output-len", "4",
        "--request-rate", "inf", "--extra-body", '{"logprobs": 0}',
        "--metrics-url", d_url + "/metrics", "--metrics-url", p_url + "/metrics",
    )  # fmt: skip
    run = report["runs"][0]
    assert run["metrics"]["completed"] == 4
    pd_stages = ["decode_admission", "prefill_queue", "prefill_compute", "kv_transfer",
                 "first_decode_step"]  # fmt: skip
    for r in run["requests"]:
        t = r["server_timings"]
        assert t["role"] == "decode" and list(t["stages"]) == ["frontend", *pd_stages]
        assert all(t["stages"][s] >= 0 for s in pd_stages), t
        assert t["stages"]["prefill_compute"] > 0
        assert sum(t["stages"].values()) == pytest.approx(t["ttft_s"])
    assert set(run["metrics"]["ttft_stages_ms"]) >= set(pd_stages)
    delta = run["server_counters"]["delta"]
    assert delta[d_url + "/metrics"]["pdserve_pd_remote_prefills_total"] == 4
    assert delta[p_url + "/metrics"]["pdserve_pd_orders_total"] == 4
    sent = delta[p_url + "/metrics"]["pdserve_kv_sent_bytes_total"]
    assert sent > 0 and delta[d_url + "/metrics"]["pdserve_kv_received_bytes_total"] == sent
    assert (tmp_path / "r_stages.png").read_bytes()[:8] == PNG_MAGIC


def test_connection_refused_is_counted_and_reported(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    report = _bench(tmp_path, url, "--num-prompts", "3", "--input-len", "4", "--output-len", "2")
    m = report["runs"][0]["metrics"]
    assert (m["completed"], m["failed"]) == (0, 3)
    assert m["failure_reasons"] == {"connect": 3}
    assert "error" in report["runs"][0]["server_counters"]["before"][url + "/metrics"]


class _FlakyServer:
    """A real HTTP server: request k (from 0) gets HTTP 500 when k % 3 == 0, a stream cut
    short (chunked, connection dropped mid-body) when k % 3 == 1, a full stream otherwise."""

    def __init__(self) -> None:
        self.port = free_port()
        self.count = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.started = threading.Event()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.srv = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self.started.set()
        self.loop.run_forever()
        self.srv.close()
        self.loop.run_until_complete(self.srv.wait_closed())
        self.loop.close()

    async def _handle(self, reader, writer) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next(
            (int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length")), 0
        )
        if length:
            await reader.readexactly(length)
        if lines[0].startswith("GET"):
            writer.write(
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
        else:
            k, self.count = self.count, self.count + 1
            if k % 3 == 0:
                body = json.dumps({"error": {"message": "engine exploded", "type": "server_error"}})
                writer.write(
                    f"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode()
                )
            else:
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                )
                events = [
                    {"choices": [{"text": "a", "finish_reason": None}]},
                    {"choices": [{"text": "b", "finish_reason": "length"}]},
                    {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}},
                ]
                frames = [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [
                    b"data: [DONE]\n\n"
                ]
                if k % 3 == 1:
                    frames = frames[:1]
                for f in frames:
                    writer.write(f"{len(f):x}\r\n".encode() + f + b"\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.01)
                if k % 3 == 1:
                    writer.write(b'40\r\ndata: {"choi')  # mid-chunk, then the connection drops
                else:
                    writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    def __enter__(self):
        self.thread.start()
        assert self.started.wait(30)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def test_http_500_and_cut_streams_are_failures_with_reasons(tmp_path):
    with _FlakyServer() as url:
        report = _bench(tmp_path, url, "--num-prompts", "9", "--input-len", "4",
                        "--output-len", "2", "--request-rate", "50", "--model", "m")  # fmt: skip
    run = report["runs"][0]
    m = run["metrics"]
    assert (m["completed"], m["failed"]) == (3, 6)
    assert m["failure_reasons"] == {"http_500": 3, "incomplete": 3}
    assert m["failure_examples"]["http_500"] == "engine exploded"
    assert m["total_output_tokens"] == 6
    bad = [r for r in run["requests"] if r["error_kind"] == "incomplete"]
    assert all(len(r["chunk_times"]) == 1 for r in bad)


def test_compare_command_prints_the_table(node, tmp_path, capsys):
    a = _bench(tmp_path, node, "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
               "--extra-body", '{"logprobs": 0}', "--label", "A", "--no-plots")  # fmt: skip
    (tmp_path / "a.json").write_text(json.dumps(a))
    capsys.readouterr()
    pdserve_main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "| metric | A | A | B/A |" in out and "| completed / failed | 2 / 0 | 2 / 0 | - |" in out


def _kv(*args: str, timeout: float = 300) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve", "bench", "kv", "--no-progress", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def test_bench_kv_between_two_processes_given_only_addresses(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    listener = _kv("--listen", addr)
    out = tmp_path / "kv.json"
    peer = _kv("--peer", addr, "--tokens", "16", "64", "--iters", "5", "--out", str(out),
               *(("--lmcache", "on", "--lmcache-iters", "2") if LMCACHE else ("--lmcache", "off")))  # fmt: skip
    p_out, p_err = peer.communicate(timeout=300)
    listener.wait(timeout=60)
    assert peer.returncode == 0, p_err[-3000:]
    assert listener.returncode == 0
    report = json.loads(out.read_text())
    assert report["bytes_verified"] is True and report["config"]["peer"] == addr
    rows = {(r["tokens"], r["method"]): r for r in report["results"]}
    methods = ("memcpy", "nixl_flat", "paged_contig", "paged_scattered", "blockmajor_contig",
               "blockmajor_scattered")  # fmt: skip
    if LMCACHE:  # the LMCache path on the same table, redis-py SET/GET as its yardstick
        lm = ("lmcache_store_visible", "lmcache_retrieve", "lmcache_bm_store_visible",
              "lmcache_bm_retrieve")  # fmt: skip
        methods += (*lm, "redis_py_set", "redis_py_get")
        for m in lm:  # both cache layouts, the same bytes
            r = rows[(64, m)]
            assert r["bytes"] == rows[(64, "paged_contig")]["bytes"] and r["descriptors"] == 1
            assert r["x_redis_py"] > 0 and r["vs_nixl_flat"] > 0
        assert report["lmcache"]["bytes_verified"] is True and "lmcache_bm_retrieve" in p_out
        assert report["lmcache"]["layouts"] == ["layer_major", "block_major"]
    assert set(rows) == {(t, m) for t in (16, 64) for m in methods}
    assert rows[(64, "paged_contig")]["bytes"] == 4 * 30 * 2 * 16 * 3 * 64 * 4
    assert rows[(64, "paged_contig")]["descriptors"] == 60
    assert rows[(64, "paged_scattered")]["descriptors"] == 4 * 60
    # block-major: a block's 30 layers, K and V, are one range; a run is one descriptor
    assert rows[(64, "blockmajor_contig")]["descriptors"] == 1
    assert rows[(64, "blockmajor_scattered")]["descriptors"] == 4
    assert rows[(64, "blockmajor_scattered")]["bytes"] == rows[(64, "paged_contig")]["bytes"]
    assert all(r["gbps"] > 0 for r in report["results"])
    assert "paged_scattered" in p_out
    # meeting the listener as a new peer: first contact -> first completed WRITE
    s = report["connection_setup"]
    assert s["write_bytes"] == 30 * 2 * 16 * 3 * 64 * 4  # one block, every layer, K and V
    for k in ("metadata_exchange_ms", "add_peer_ms", "warmup_ms", "first_write_ms"):
        assert 0 < s[k] < s["contact_to_first_write_ms"], (k, s)
    assert s["warmup_ok"] is True  # the connection warm-up completed
    assert s["warm_write_ms"] > 0 and s["first_vs_warm"] > 0
    parts = s["metadata_exchange_ms"] + s["add_peer_ms"] + s["warmup_ms"] + s["first_write_ms"]
    assert s["contact_to_first_write_ms"] == pytest.approx(parts, abs=1e-3)
    assert s["setup_ms"] == pytest.approx(s["contact_to_first_write_ms"] - s["warm_write_ms"],
                                          abs=1e-3)  # fmt: skip
    assert s["listener_setup_ms"] > 0 and "first contact -> first WRITE done" in p_out
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


def test_bench_kv_listener_refuses_a_geometry_over_its_limit(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    listener = _kv("--listen", addr, "--max-bytes", "1000000")
    peer = _kv("--peer", addr, "--tokens", "1024", "--out", str(tmp_path / "kv.json"))
    _, p_err = peer.communicate(timeout=120)
    listener.wait(timeout=60)
    assert peer.returncode != 0 and "refused" in p_err and "--max-bytes" in p_err
    assert listener.returncode == 0


def test_bench_kv_listener_gives_up_when_nobody_comes():
    listener = _kv("--listen", f"127.0.0.1:{free_port()}", "--listen-timeout", "1")
    _, err = listener.communicate(timeout=120)
    assert listener.returncode != 0 and "no initiator within 1 s" in err

"""Drill 5 of issue 27: prefill hosts whose wall clocks are 10 s behind and 10 s ahead.

Three hosts (network namespaces, tests/multihost/hosts.py): a decode node on h1, a prefill
node on h2 running under faketime 10 s behind, one on h3 10 s ahead (monotonic clocks
untouched, as NTP would leave them). A cluster secret seals and encrypts the KV control
channel. The decode node's transfer timeout is short (1 s, grace 0.5 s) and the prefill
nodes stutter: their processes are stopped (SIGSTOP) for 1.6 s and run for 0.6 s in turn,
as hosts pausing or steps taking seconds would, so orders wait past their deadline, aborts
arrive while a step runs, and attempts fail over, under a steady load of completions
spread over both prefill nodes.

The decode node runs the KV poison audit (`PDSERVE_KV_POISON=1`, decode/poison.py): every
block an attempt gives back is filled with +inf and checked until it is handed out again,
so a WRITE that lands after its release is counted. The drill asserts none did, every
output equals the transformers reference, and every block is back at the end.

With the code before the lease/fence protocol (the decode node reusing blocks at the
order's `expires_at` + grace on its own clock; the prefill node posting until
`expires_at` on its own, after a step, before reading an abort), this drill counted
late WRITEs into released blocks (docs/architecture.md, "Leases and fencing").
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdserve.api.cluster_secret import NODE_KEY_HEADER, node_key
from tests.hf_reference import hf_greedy, load_hf
from tests.multihost.hosts import Hosts
from tests.servers import ROOT

pytest.importorskip("nixl")

PREFIX = os.environ.get("PDSERVE_CLOCK_DRILL_PREFIX", "clk")
SUBNET = os.environ.get("PDSERVE_CLOCK_DRILL_SUBNET", "10.213.41.0/24")
HTTP, CTL = 8000, 5555
SKEW = {"h2": -10.0, "h3": +10.0}
REQUESTS, CLIENTS, MAX_TOKENS = 60, 8, 4
# FAKETIME: the whole clock moves by the offset, the monotonic one too (a constant shift
# of it, as another host's monotonic clock has another origin anyway): libfaketime 0.9.10
# with FAKETIME_DONT_FAKE_MONOTONIC=1 makes Python's time.sleep fail with EINVAL
# (clock_nanosleep on the real monotonic clock), which broke the nodes' NIXL warm-up.


def _node(hosts, host, secret_file, model, *extra) -> list[str]:
    return [
        sys.executable, "-m", "pdserve", "serve", "--model", model,
        "--host", hosts.addr(host), "--port", str(HTTP),
        "--cluster-secret-file", str(secret_file), "--num-threads", "1",
        "--num-blocks", "128", "--log-level", "info", *extra,
    ]  # fmt: skip


def _wait_up(url: str, headers: dict, procs, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for p in procs:
            assert p.poll() is None, f"{p.argv[:8]} exited; see {p.log}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not up in {timeout_s} s"
        time.sleep(0.5)


def _stats(url: str, headers: dict) -> dict:
    r = httpx.get(f"{url}/debug/engine", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _stutter(procs, stop: threading.Event, off_s=1.6, on_s=0.6) -> None:
    """Stop each prefill node in turn for `off_s`, let it run `on_s`."""
    i = 0
    while not stop.is_set():
        p = procs[i % len(procs)]
        p.signal(signal.SIGSTOP)
        stop.wait(off_s)
        p.signal(signal.SIGCONT)
        stop.wait(on_s)
        i += 1


@pytest.fixture(scope="module")
def skewed(tmp_path_factory, tiny_llama_dir):
    keep = os.environ.get("PDSERVE_CLOCK_DRILL_DIR")  # keep the node logs there
    run = Path(keep) if keep else tmp_path_factory.mktemp("clock_drill")
    run.mkdir(parents=True, exist_ok=True)
    secret = run / "cluster.secret"
    secret.write_bytes(os.urandom(24).hex().encode())
    headers = {NODE_KEY_HEADER: node_key(secret.read_bytes())}
    hosts = Hosts(3, prefix=PREFIX, subnet=SUBNET).up()
    try:
        ctl = {h: f"tcp://{hosts.addr(h)}:{CTL}" for h in SKEW}
        prefills = [
            hosts.run(
                h,
                [
                    "faketime",
                    "-f",
                    f"{SKEW[h]:+g}s",  # the whole clock: see FAKETIME above
                    *_node(
                        hosts,
                        h,
                        secret,
                        tiny_llama_dir,
                        "--role",
                        "prefill",
                        "--kv-control",
                        ctl[h],
                        "--max-num-batched-tokens",
                        "32",
                    ),
                ],
                log=run / f"{h}.log",
                cwd=ROOT,
            )  # fmt: skip
            for h in SKEW
        ]
        decode = hosts.run(
            "h1",
            _node(hosts, "h1", secret, tiny_llama_dir, "--role", "decode",
                  "--prefill-node", ctl["h2"], "--prefill-node", ctl["h3"],
                  "--kv-transfer-timeout", "1.0", "--kv-abort-grace", "0.5"),
            log=run / "h1.log", cwd=ROOT, env={**os.environ, "PDSERVE_KV_POISON": "1"},
        )  # fmt: skip
        urls = {h: f"http://{hosts.addr(h)}:{HTTP}" for h in ("h1", "h2", "h3")}
        for url in urls.values():
            _wait_up(url, headers, [decode, *prefills])
        yield hosts, urls, ctl, headers, prefills, run
    finally:
        hosts.down()


def test_skewed_prefill_clocks_never_write_into_reused_blocks(skewed, tiny_llama_dir):
    hosts, urls, ctl, headers, prefills, run = skewed
    # each host's wall clock is off as configured (faketime)
    for h, off in SKEW.items():
        wall = float(hosts.check(h, ["faketime", "-f", f"{off:+g}s", "date", "+%s.%N"]))
        assert abs(wall - time.time() - off) < 2.0, (h, wall - time.time())
    hf = load_hf(tiny_llama_dir)
    rng = random.Random(5)
    jobs = [
        ([rng.randrange(3, 1000) for _ in range(rng.randint(150, 400))], ctl[("h2", "h3")[i % 2]])
        for i in range(REQUESTS)
    ]
    decode = urls["h1"]

    def one(job) -> list[int]:
        prompt, node = job
        body = {
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "kv_transfer_params": {"prefill_node": node},
        }  # fmt: skip
        r = httpx.post(f"{decode}/v1/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        # no tokenizer: each token's string is "token_id:N"
        return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

    stop = threading.Event()
    stutter = threading.Thread(target=_stutter, args=(prefills, stop), daemon=True)
    t0 = time.monotonic()
    stutter.start()
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            outs = list(pool.map(one, jobs))
    finally:
        stop.set()
        stutter.join()
        for p in prefills:
            p.signal(signal.SIGCONT)
    took = time.monotonic() - t0
    # every output exact
    for (prompt, _), out in zip(jobs, outs):
        assert out == hf_greedy(hf, prompt, MAX_TOKENS)
    # every block back, no late WRITE seen by the poison audit
    deadline = time.monotonic() + 60
    while True:
        states = {h: _stats(u, headers) for h, u in urls.items()}
        if all(s["stats"]["kv_blocks_used"] == 0 for s in states.values()):
            break
        assert time.monotonic() < deadline, {h: s["stats"] for h, s in states.items()}
        time.sleep(0.5)
    d = states["h1"]["stats"]
    for h, s in states.items():
        assert s["integrity"]["ok"], (h, s["integrity"])
    print(
        f"\ndrill 5: {REQUESTS} requests in {took:.1f} s; remote prefills "
        f"{d['pd_remote_prefills']}, failed over {d['pd_failures']}, orders taken "
        f"h2(-10 s) {states['h2']['stats']['pd_orders']}, h3(+10 s) "
        f"{states['h3']['stats']['pd_orders']}; late WRITEs {d['kv_poison_violations']}"
    )
    assert d["kv_poison_violations"] == 0
    assert d["pd_failures"] > 0  # the stutter did make attempts fail
    for h in SKEW:  # both skewed prefill nodes served orders
        assert states[h]["stats"]["pd_orders"] > 0, h

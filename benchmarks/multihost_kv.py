"""`pdserve bench kv` between two hosts, beside a plain TCP stream between the same hosts.

The hosts are network namespaces on a bridge (tests/multihost/hosts.py): the listener on
h2, the initiator on h1, UCX over TCP only (`UCX_TLS=tcp`: on one machine UCX would
otherwise take its shared-memory transports across namespaces) on each host's `eth0`. The
limit is an iperf3 TCP stream from h1 to h2 over the same veth link; each paged NIXL WRITE
size is reported as a fraction of it.

    python benchmarks/multihost_kv.py --tokens 256 1024 4096 --out results/multihost_kv.json

Needs root (namespaces) and iperf3. docs/benchmarks.md "KV transfer between two hosts".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as a script: the repo root
from tests.multihost.hosts import Hosts  # noqa: E402

PORT, IPERF_PORT = 7300, 5201
METHODS = ("paged_contig", "paged_scattered", "nixl_flat")


def tcp_limit_gbps(hosts: Hosts, seconds: float) -> float:
    """One iperf3 TCP stream h1 -> h2, in GB/s (bytes, like the KV figures)."""
    cmd = ["iperf3", "-c", hosts.addr("h2"), "-p", str(IPERF_PORT), "-B", hosts.addr("h1"),
           "-t", str(seconds), "-J"]  # fmt: skip
    server = hosts.run("h2", ["iperf3", "-s", "-B", hosts.addr("h2"), "-p", str(IPERF_PORT)])
    try:
        deadline = time.monotonic() + 30
        while True:  # until the server listens (iperf3 -J reports a refusal as "error")
            run = subprocess.run(hosts.wrap("h1", cmd), capture_output=True, text=True,
                                 timeout=seconds + 30)  # fmt: skip
            data = json.loads(run.stdout or "{}")
            if "error" not in data and "sum_received" in data.get("end", {}):
                return data["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
            if time.monotonic() > deadline:
                raise RuntimeError(f"iperf3 h1 -> h2 failed: {data.get('error', run.stderr)}")
            time.sleep(0.2)
    finally:
        server.stop(2)


def kv_rows(hosts: Hosts, tokens: list[int], iters: int, out: Path) -> dict:
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    target = f"{hosts.addr('h2')}:{PORT}"
    bench = [sys.executable, "-m", "pdserve", "bench", "kv"]
    listener = hosts.run("h2", [*bench, "--listen", target, "--listen-timeout", "120"], env=env)
    try:
        cmd = [*bench, "--peer", target, "--tokens", *map(str, tokens), "--iters", str(iters),
               "--warmup", "1", "--no-progress", "--lmcache", "off", "--out", str(out)]  # fmt: skip
        hosts.check("h1", cmd, timeout_s=600, env=env)
    finally:
        listener.stop(5)
    return json.loads(out.read_text())


def run(tokens: list[int], iters: int, out: Path, prefix: str, subnet: str, tcp_s: float) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    with Hosts(2, prefix, subnet) as hosts:
        limit = tcp_limit_gbps(hosts, tcp_s)
        kv = kv_rows(hosts, tokens, iters, out.with_name(out.stem + "_nixl.json"))
    rows = [
        {**{k: r[k] for k in ("tokens", "method", "bytes", "p50_ms", "gbps")},
         "of_tcp": round(r["gbps"] / limit, 3)}
        for r in kv["results"] if r["method"] in METHODS
    ]  # fmt: skip
    report = {
        "link": "veth pair + bridge between two network namespaces, UCX_TLS=tcp",
        "tcp_stream_gbps": round(limit, 3),
        "bytes_verified": kv["bytes_verified"],
        "results": rows,
    }
    out.write_text(json.dumps(report, indent=2))
    return report


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multihost_kv")
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tcp-seconds", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=Path("results/multihost_kv.json"))
    p.add_argument("--prefix", default="pdkv")
    p.add_argument("--subnet", default="10.76.0.0/24")
    a = p.parse_args()
    report = run(a.tokens, a.iters, a.out, a.prefix, a.subnet, a.tcp_seconds)
    print(f"TCP stream h1 -> h2: {report['tcp_stream_gbps']:.3f} GB/s")
    for r in report["results"]:
        print(f"{r['tokens']:>6} {r['method']:<16} {r['gbps']:>7.3f} GB/s  {r['of_tcp']:.2f}x TCP")


if __name__ == "__main__":
    main()

"""`benchmarks/multihost_kv.py` once, at a small size: `pdserve bench kv` between two hosts
(UCX over TCP on the veth link, the written blocks verified by the listener) beside an
iperf3 stream between the same hosts."""

from __future__ import annotations

import shutil

import pytest

from benchmarks.multihost_kv import run
from tests.multihost.hosts import leftovers

pytest.importorskip("nixl")


@pytest.mark.skipif(not shutil.which("iperf3"), reason="iperf3 is missing (scripts/setup.sh)")
def test_bench_kv_between_two_hosts(tmp_path):
    out = tmp_path / "multihost_kv.json"
    report = run([64], iters=2, out=out, prefix="pdkt", subnet="10.80.0.0/24", tcp_s=1.0)
    assert report["bytes_verified"] is True
    assert report["tcp_stream_gbps"] > 0.01
    methods = {r["method"]: r for r in report["results"]}
    assert set(methods) == {"paged_contig", "paged_scattered", "nixl_flat"}
    for r in methods.values():
        # 64 tokens, 2 iterations and a 1 s TCP stream on a busy 2-core box are noisy (CI
        # once measured 2.5x); a shared-memory bypass of the link is far above this bound,
        # and drill 6 checks the KV is held to a capped link's rate.
        assert r["tokens"] == 64 and r["gbps"] > 0 and 0 < r["of_tcp"] < 5, r
    assert out.exists() and leftovers("pdkt") == {"netns": [], "links": []}

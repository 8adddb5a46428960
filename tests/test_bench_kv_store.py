"""`pdserve bench kv-store`: a small run through real LMCache and redis-server."""

import json
import subprocess
import sys

import pytest

from tests.servers import ROOT

pytest.importorskip("lmcache")


def test_kv_store_bench_writes_report(tmp_path):
    out = tmp_path / "kv_store.json"
    cmd = [sys.executable, "-m", "pdserve", "bench", "kv-store", "--out", str(out)]
    cmd += ["--tokens", "40", "96", "--chunk", "32", "--iters", "2", "--log-level", "warning"]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=300)
    report = json.loads(out.read_text())
    rows = {r["tokens"]: r for r in report["rows"]}
    assert set(rows) == {40, 96}
    # 30 layers x K,V x 3 heads x 64 x fp32 per token; 40 tokens = 2 chunks (one partial)
    assert rows[40]["bytes"] == 40 * 30 * 2 * 3 * 64 * 4 and rows[40]["chunks"] == 2
    for row in rows.values():
        paths = ("lmcache_store_visible", "lmcache_retrieve", "lmcache_retrieve_builtin",
                 "lmcache_bm_store_visible", "lmcache_bm_retrieve")  # block-major cache too  # fmt: skip
        for path in (*paths, "redis_py_set", "redis_py_get"):
            assert row[path]["gbps"] > 0

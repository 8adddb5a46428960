"""Fault drills on a real local cluster under steady load (see tests/faults/harness.py).

One cluster per module: `pdserve launch` with embedded Redis, the router, 2 prefill nodes
and 1 decode node (tiny random Llama, real NIXL, real HTTP). Each drill injects one fault
mid-load, then checks: every request got a terminal answer (complete, or a clear error)
within its deadline; the cluster serves again without anyone acting; every node's
`check_integrity()` holds and its KV blocks in use fall back to 0; the Redis index holds
no set of a dead epoch. Figures (requests in flight and their outcomes, time to recovery)
are printed (`pytest -s`) and written to $PDSERVE_DRILL_REPORT when set.

Which drills run by default: all of them here take about 4-6 minutes together on a 2-core
box (one cluster start, then ~30-60 s per drill); `pytest -m faults` runs them alone, and
`-m "not faults"` leaves them out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.faults.harness import DEADLINE_S, Cluster, Load, wait_serving
from tests.servers import descendants, engine_core_of

pytestmark = [pytest.mark.faults]
pytest.importorskip("nixl")

REPORT: list[dict] = []
LOAD_S = 4.0  # steady load before the fault


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    c = Cluster(tiny_llama_dir, tmp_path_factory.mktemp("drills"))
    try:
        t0 = time.monotonic()
        c.wait_up()
        wait_serving(c.router_url, 120)
        print(f"\ncluster up in {time.monotonic() - t0:.1f} s")
        yield c
    finally:
        c.stop()
        if os.environ.get("PDSERVE_DRILL_REPORT"):
            with open(os.environ["PDSERVE_DRILL_REPORT"], "w") as f:
                json.dump(REPORT, f, indent=1)


def run_drill(cluster: Cluster, name: str, inject, *, routers=None, disconnect_rate=0.0,
              recover_timeout_s: float = 120, restarted: str | None = None) -> dict:  # fmt: skip
    routers = routers or [cluster.router_url]
    before = cluster.service(restarted)["pid"] if restarted else None
    load = Load(routers, clients=4, disconnect_rate=disconnect_rate).start()
    time.sleep(LOAD_S)
    t_fault = time.monotonic()
    inject()
    # Recovery: the cluster answers again, from the routers the clients use.
    try:
        recovery_s = max(wait_serving(r, recover_timeout_s) for r in routers)
    except AssertionError as e:
        raise AssertionError(f"{name}: {e}\n{cluster.diagnosis()}") from None
    time.sleep(2.0)  # a little load on the recovered cluster too
    load.stop()
    if restarted:
        cluster.wait_up(120)
        assert cluster.service(restarted)["pid"] != before  # the launcher restarted it
    in_flight = [o for o in load.outcomes if o.started <= t_fault < o.ended]
    not_terminal = [o for o in load.outcomes if not o.terminal]
    assert not_terminal == [], f"{name}: requests without a terminal answer: {not_terminal}"
    longest = max(o.ended - o.started for o in load.outcomes)
    assert longest < DEADLINE_S + 5
    used = cluster.wait_blocks_idle()
    cluster.wait_no_dead_epochs()
    row = {
        "drill": name,
        "requests": len(load.outcomes),
        "outcomes": load.summary(),
        "in_flight_at_fault": len(in_flight),
        "in_flight_outcomes": _count(o.kind for o in in_flight),
        "recovery_s": round(recovery_s, 2),
        "longest_request_s": round(longest, 2),
        "leaked_blocks": sum(used.values()),
    }
    REPORT.append(row)
    print(f"\nDRILL {json.dumps(row)}")
    assert load.summary(t_fault + recovery_s + 1).get("ok", 0) > 0  # serving after recovery
    return row


def _count(kinds) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in kinds:
        out[k] = out.get(k, 0) + 1
    return out


def kill(cluster: Cluster, name: str) -> None:
    os.killpg(cluster.service(name)["pid"], signal.SIGKILL)


def test_baseline_no_fault(cluster):
    row = run_drill(cluster, "baseline", lambda: None)
    assert set(row["outcomes"]) == {"ok"}
    # The cluster has a secret: nodes answer the router only, not a client going round it.
    node = cluster.service("decode-0")["url"]
    r = httpx.post(f"{node}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_node_key"


def test_every_process_listens_on_loopback_only(cluster):
    """Redis, router, nodes' HTTP and KV control, NIXL/UCX: nothing beyond loopback."""
    pids = descendants(cluster.proc.pid)
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    addrs = [line.split()[3] for line in out.splitlines()
             if any(f"pid={pid}," in line for pid in pids)]  # fmt: skip
    assert len(addrs) >= 8, addrs  # redis, router, 3 x HTTP, 2 x KV control, UCX ...
    outside = [a for a in addrs if not a.startswith(("127.", "[::1]"))]
    assert outside == [], f"listening beyond loopback: {outside}"


def test_client_disconnects(cluster):
    row = run_drill(cluster, "client disconnects", lambda: None, disconnect_rate=0.5)
    assert row["outcomes"].get("disconnected", 0) > 0


def test_sigkill_prefill_node(cluster):
    run_drill(cluster, "SIGKILL prefill-0", lambda: kill(cluster, "prefill-0"),
              restarted="prefill-0")  # fmt: skip


def test_sigkill_decode_node(cluster):
    run_drill(cluster, "SIGKILL decode-0", lambda: kill(cluster, "decode-0"),
              restarted="decode-0")  # fmt: skip


def test_sigkill_decode_engine_core(cluster):
    """Issue 29 item 3: the OOM killer's usual pick, the EngineCore, dies alone. The node
    does not stay up as a zombie: its requests end, it leaves the registry and exits, the
    launcher restarts it, and the cluster serves again unaided."""
    pid = engine_core_of(cluster.service("decode-0")["pid"])
    run_drill(cluster, "SIGKILL decode-0's EngineCore", lambda: os.kill(pid, signal.SIGKILL),
              restarted="decode-0")  # fmt: skip


def test_sigstop_then_sigcont_prefill_node(cluster):
    def stall():
        pid = cluster.service("prefill-1")["pid"]
        os.killpg(pid, signal.SIGSTOP)
        time.sleep(8)  # past the decode node's peer timeout (3 s): transfers hang, not fail
        os.killpg(pid, signal.SIGCONT)

    run_drill(cluster, "SIGSTOP/SIGCONT prefill-1 (8 s)", stall)


def test_sigkill_redis(cluster):
    run_drill(cluster, "SIGKILL redis", lambda: kill(cluster, "redis"), restarted="redis")


def test_sigkill_router_with_two_replicas(cluster):
    second = cluster.start_extra_router()
    run_drill(cluster, "SIGKILL router (2 replicas)", lambda: kill(cluster, "router"),
              routers=[cluster.router_url, second], restarted="router")  # fmt: skip

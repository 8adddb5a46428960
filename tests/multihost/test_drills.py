"""Drills on a cluster across hosts (configs/multihost-ray.yaml on tests/multihost/hosts.py).

One cluster for the module: h1 Ray head + Redis + `pdserve launch` + router, h2 the prefill
node, h3 the decode node (the real default model, real NIXL over UCX/TCP on the veth
links). h2's clock is 5 h ahead (libfaketime under its Ray worker), and drill 5 restarts
its node 5 h behind. Each drill runs the reference load (tests/multihost/load.py: greedy answers known
from transformers) through a fault, then checks: no answer differs from the reference, every
request ended (an answer or a clear error) within its deadline, and every reachable node
gets back to 0 KV blocks used or held with `check_integrity()` holding. The figures (sent,
completed, failed over, terminal errors, longest request, leaked blocks) are printed
(`pytest -s`). The last drill loses h2 for good; the module then asserts that no namespace,
link, Ray or node process is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.multihost.checks import assert_log_collected, check_binds, clock_skew
from tests.multihost.cluster import MultiHostCluster
from tests.multihost.hosts import Hosts, leftovers
from tests.multihost.load import CLIENT_DEADLINE_S, Load, Outcome, counts, references, send
from tests.servers import alive

pytest.importorskip("nixl")
pytest.importorskip("ray", reason="ray is not installed (pip install 'pdserve[ray]')")

MODEL = "smollm2-135m-instruct"
NODES = {"prefill-0", "decode-0", "router"}
PATCH = {
    # A silent decode node: its streams end after 6 s without a byte. (Cuts stay under
    # Ray's own health-check window, ~15 s, past which Ray declares the host dead.)
    "router": {"request_timeout_s": 6},
    "prefill": {"connector": {"transfer_timeout_s": 8, "peer_timeout_s": 2}},
    # Decode without a prefix cache: every request of the repeating load is a remote prefill.
    "decode": {
        "connector": {"transfer_timeout_s": 8, "peer_timeout_s": 2},
        "enable_prefix_caching": False,
    },
}
REPORT: list[dict] = []
SKEW_H = 5  # the prefill host's clock offset, hours (ahead, then behind: test_5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdserve.common.model_files import resolve_model

    hosts = Hosts(3).up()
    run_root = tmp_path_factory.mktemp("multihost")
    c = MultiHostCluster(hosts, run_root, MODEL, PATCH, clock_offsets={"h2": f"+{SKEW_H}h"})
    try:
        t0 = time.monotonic()
        c.start()
        c.reqs = references(str(resolve_model(MODEL)))  # while the cluster starts
        c.wait_up(NODES)
        wait_serving(c)
        print(f"\nmultihost cluster up in {time.monotonic() - t0:.1f} s")
        yield c
    finally:
        c.stop()
        left = {h: [p for p in hosts.pids(h) if alive(p)] for h in hosts.names}
        hosts.down()
        print(f"\nMULTIHOST REPORT {json.dumps(REPORT)}")
    assert left == {h: [] for h in hosts.names}, f"processes left on the hosts: {left}"
    assert leftovers(hosts.prefix) == {"netns": [], "links": []}


def wait_serving(c: MultiHostCluster, timeout_s: float = 60) -> float:
    """Seconds until the router answers a reference request exactly."""
    t0 = time.monotonic()
    with httpx.Client(timeout=CLIENT_DEADLINE_S) as client:
        while (out := send(client, c.router_url, c.reqs[0], stream=False)).kind != "ok":
            assert out.kind != "wrong", out.detail
            assert time.monotonic() - t0 < timeout_s, f"not serving in {timeout_s} s: {out}"
            time.sleep(0.3)
    return time.monotonic() - t0


def wait_idle(c: MultiHostCluster, names=("prefill-0", "decode-0"), timeout_s=40) -> int:
    """Until every named node runs nothing and uses or holds no KV block (integrity checked
    each time); returns the blocks still used or held (0, or the assert fires)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            engines = {n: c.engine(n) for n in names}
        except (httpx.HTTPError, ValueError):
            engines = None
        if engines:
            for n, e in engines.items():
                assert e["integrity"]["ok"], f"{n}: {e['integrity']['error']}"
            s = [e["stats"] for e in engines.values()]
            blocks = sum(x["kv_blocks_used"] + x["kv_blocks_held"] for x in s)
            if blocks == 0 and not sum(x["num_running"] + x["num_waiting"] for x in s):
                return 0
        assert time.monotonic() < deadline, f"blocks not back to idle: {engines}"
        time.sleep(0.5)


def stat(c: MultiHostCluster, node: str, key: str) -> int:
    return c.engine(node)["stats"][key]


def report(name: str, outcomes: list[Outcome], failed_over: int, leaked: int) -> dict:
    kinds = counts(outcomes)
    assert kinds.get("wrong", 0) == 0, [o.detail for o in outcomes if o.kind == "wrong"]
    late = [o for o in outcomes if o.kind in ("timeout", "truncated")]
    assert late == [], f"{name}: requests without a terminal answer: {late}"
    longest = max(o.took_s for o in outcomes)
    assert longest < CLIENT_DEADLINE_S
    row = {
        "drill": name,
        "sent": len(outcomes),
        "completed": kinds.get("ok", 0),
        "failed_over": failed_over,
        "terminal_errors": len(outcomes) - kinds.get("ok", 0),
        "outcomes": kinds,
        "longest_s": round(longest, 2),
        "leaked_blocks": leaked,
    }
    REPORT.append(row)
    print(f"\nDRILL {json.dumps(row)}")
    return row


def run_load(c: MultiHostCluster, fault, clients: int = 2, before_s: float = 2.0):
    """Load, then `fault()` (which returns when the fault is over), then a little more load."""
    failures = stat(c, "decode-0", "pd_failures")
    load = Load(c.router_url, c.reqs, clients).start()
    time.sleep(before_s)
    fault()
    time.sleep(1.0)
    outcomes = load.stop()
    return outcomes, stat(c, "decode-0", "pd_failures") - failures


def test_1_no_fault(cluster):
    """Chat and completions, streamed and not, all prefilled on the prefill host."""
    c = cluster
    orders, remote = stat(c, "prefill-0", "pd_orders"), stat(c, "decode-0", "pd_remote_prefills")
    with httpx.Client(timeout=CLIENT_DEADLINE_S) as client:
        outcomes = [send(client, c.router_url, r, stream) for r in c.reqs for stream in (0, 1)]
    row = report("1 no fault", outcomes, 0, wait_idle(c))
    assert row["completed"] == len(outcomes) == 2 * len(c.reqs)
    # Every request was prefilled on h2 and its KV moved to h3.
    assert stat(c, "prefill-0", "pd_orders") - orders == len(outcomes)
    assert stat(c, "decode-0", "pd_remote_prefills") - remote == len(outcomes)
    assert stat(c, "decode-0", "kv_bytes_received") > 0
    # `pdserve status` from this machine (another host to the cluster) sees every process.
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "status", str(c.config_path)],  # its secret, its Redis
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    out = out.stdout + out.stderr
    assert "IGNORED" not in out, out  # every record is signed with the cluster secret
    for name in NODES:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(name))
        assert " up " in line and " 200 " in line, out


def test_every_process_binds_its_own_host_address(cluster):
    """`ss` inside each host, every listener: Redis, the router, each node's HTTP, KV control
    and NIXL/UCX listeners on the address the config gives that host (nothing on 0.0.0.0 or
    loopback); any other process on its host's address or loopback, except Ray's own
    listeners that Ray 2.60 binds on every address (GCS, raylet, core workers and the driver,
    the autoscaler's metrics), which must be on the ports cluster.py pins for a firewall."""
    c = cluster
    ours = {c.redis.pid, *(s["pid"] for s in c.state()["services"])}
    seen, wrong, ray_any = check_binds(c.hosts, ours, c.launcher.pid)
    assert not wrong, wrong
    # h1: redis, router; h2: HTTP, KV control, UCX; h3: HTTP, UCX.
    assert len(seen["h1"]) >= 2 and len(seen["h2"]) >= 3 and len(seen["h3"]) >= 2, seen
    print(f"\nRay listeners on every address: {ray_any}")


def test_bind_check_reports_a_stray_wildcard_listener(cluster, tmp_path):
    """The exception for Ray is narrow: a wildcard listener is reported when it is not
    Ray's (even on a pinned port), or when it is a Ray worker's on a port not pinned."""
    c, hosts = cluster, cluster.hosts
    listen = "import socket,sys,time; s=socket.socket(); s.bind(('0.0.0.0',int(sys.argv[1]))); s.listen(); time.sleep(60)"
    fake_ray = tmp_path / "workers" / "default_worker.py"  # looks like a Ray core worker
    fake_ray.parent.mkdir()
    fake_ray.write_text(listen)
    strays = {  # (host, port): argv
        ("h2", 10500): [sys.executable, "-c", listen, "10500"],  # a Ray port, not Ray
        ("h3", 7777): [sys.executable, str(fake_ray), "7777"],  # Ray-like, port not pinned
    }
    procs = [hosts.run(h, argv) for (h, _), argv in strays.items()]
    try:
        deadline = time.monotonic() + 20
        while True:
            ours = {c.redis.pid, *(s["pid"] for s in c.state()["services"])}
            _, wrong, _ = check_binds(hosts, ours, c.launcher.pid)
            found = {(h, port) for (h, port) in strays if any(
                f":{port} " in ln and f"pid={p.pid}," in ln
                for ln in wrong.get(h, []) for p in procs)}  # fmt: skip
            if found == set(strays):
                break
            assert time.monotonic() < deadline, (found, wrong)
            time.sleep(0.3)
        assert all("0.0.0.0" in ln or "*:" in ln for h in wrong for ln in wrong[h])
    finally:
        for p in procs:
            p.stop(grace_s=1)


def test_2_prefill_host_cut_mid_transfer_then_healed(cluster):
    """Requests fail over (local prefill on h3) when h2 goes silent; after the heal, h2's
    prefill node takes orders again without a restart."""
    c, hosts = cluster, cluster.hosts
    pid = c.service("prefill-0")["pid"]
    healed = {}

    def fault():
        sent = stat(c, "prefill-0", "kv_bytes_sent")
        deadline = time.monotonic() + 10
        while stat(c, "prefill-0", "kv_bytes_sent") == sent:  # cut while KV is moving
            assert time.monotonic() < deadline, "no KV transfer under load"
            time.sleep(0.05)
        hosts.cut("h2")
        time.sleep(5.0)  # beyond the 2 s peer timeout
        hosts.heal("h2")
        healed["orders"] = _until(lambda: stat(c, "prefill-0", "pd_orders"), timeout_s=20)
        deadline = time.monotonic() + 40
        while stat(c, "prefill-0", "pd_orders") <= healed["orders"]:
            assert time.monotonic() < deadline, "the prefill node takes no order after the heal"
            time.sleep(0.3)

    outcomes, failed_over = run_load(c, fault)
    row = report("2 prefill host cut mid-transfer", outcomes, failed_over, wait_idle(c))
    assert failed_over > 0 and row["completed"] > 0
    assert c.service("prefill-0")["pid"] == pid  # served again, not restarted
    # The failovers' log lines came back to the launcher from the decode host.
    assert_log_collected(c, "decode-0", r"request \S+: remote prefill failed")


def _until(fn, timeout_s: float):
    """fn()'s first value that does not raise within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except (httpx.HTTPError, ValueError):
            assert time.monotonic() < deadline
            time.sleep(0.3)


def test_3_decode_host_cut_mid_stream(cluster):
    """Streams cut by a silent decode host end with an error within their deadline; the
    router stops routing there (503 "no usable decode node"), and routes there again after
    the heal."""
    c, hosts = cluster, cluster.hosts
    stopped = {}

    def fault():
        hosts.cut("h3")
        t0 = stopped["cut"] = time.monotonic()
        while httpx.get(f"{c.router_url}/health", timeout=5).status_code != 503:
            assert time.monotonic() - t0 < 15, "the router still routes to the cut decode node"
            time.sleep(0.2)
        stopped["s"] = time.monotonic() - t0
        time.sleep(max(0.0, 7.5 - (time.monotonic() - t0)))  # past the router's 6 s
        hosts.heal("h3")
        stopped["back"] = wait_serving(c, 40)

    outcomes, failed_over = run_load(c, fault)
    report("3 decode host cut mid-stream", outcomes, failed_over, wait_idle(c))
    # The requests the cut caught mid-way ended with an error, not silence. One may end
    # ok: a buffered request whose every token (its finish chunk) the router already held
    # when the cut came, missing only the usage and [DONE], which the router completes
    # itself (router/migration.py: nothing unfinished is left to move). Its text is the
    # reference's (`report` fails on a wrong one).
    caught = [o for o in outcomes if o.started < stopped["cut"] < o.ended]
    print(f"in flight at the cut: {counts(caught)}")
    assert any(o.kind != "ok" for o in caught), caught
    assert all(o.kind in ("ok", "stream_error") or o.kind.startswith("http_") for o in caught)
    print(f"router stopped routing to h3 after {stopped['s']:.1f} s, back {stopped['back']:.1f}")


def test_4_router_host_cut_from_redis(cluster):
    """The router keeps serving on the nodes it knows while Redis is unreachable from its
    host (iptables inside h1: the nodes on h2/h3 still reach Redis), and reconnects after."""
    c, hosts = cluster, cluster.hosts
    rule = ["INPUT", "-p", "tcp", "-s", hosts.addr("h1"), "--dport", str(c.redis_port),
            "-j", "DROP"]  # fmt: skip

    def redis_up() -> bool:
        return httpx.get(f"{c.router_url}/cluster", timeout=5).json()["redis"]["up"]

    def fault():
        hosts.check("h1", ["iptables", "-I", *rule])
        try:
            t0 = time.monotonic()
            while redis_up():
                assert time.monotonic() - t0 < 15, "the router never noticed Redis is gone"
                time.sleep(0.2)
            time.sleep(4.0)  # serving on what it knows
        finally:
            hosts.check("h1", ["iptables", "-D", *rule])
        t0 = time.monotonic()
        while not redis_up():
            assert time.monotonic() - t0 < 15, "the router did not reconnect to Redis"
            time.sleep(0.2)

    outcomes, failed_over = run_load(c, fault)
    row = report("4 router host cut from Redis", outcomes, failed_over, wait_idle(c))
    assert row["completed"] == row["sent"]  # nothing failed: the router knew its nodes


def test_5_prefill_host_clock_hours_off(cluster):
    """The prefill host's clock 5 h ahead (every drill so far ran so: its Ray worker, the
    node actor and the node process are under libfaketime), then the node process
    restarted by the launcher 5 h behind: through the router, every answer exact, every
    request prefilled on that host, every block back."""
    c = cluster
    rows = []
    for sign in ("+", "-"):
        if sign == "-":
            old = c.service("prefill-0")["pid"]
            c.set_clock_offset("h2", f"-{SKEW_H}h")  # for the node process started next
            os.kill(old, signal.SIGKILL)  # the launcher restarts it (same actor, same host)
            deadline = time.monotonic() + 120
            while not (
                c.service("prefill-0")["pid"] != old and c.service("prefill-0")["state"] == "up"
            ):
                assert time.monotonic() < deadline, c.log("launcher.out")
                time.sleep(0.5)
            wait_serving(c, 60)
        skew = clock_skew(c.service("prefill-0")["url"])
        assert abs(skew - float(f"{sign}{SKEW_H}") * 3600) < 120, skew
        orders = stat(c, "prefill-0", "pd_orders")
        with httpx.Client(timeout=CLIENT_DEADLINE_S) as client:
            outcomes = [send(client, c.router_url, r, s) for r in c.reqs for s in (0, 1)]
        row = report(f"5 prefill host clock {sign}{SKEW_H} h", outcomes, 0, wait_idle(c))
        assert row["completed"] == row["sent"]
        assert stat(c, "prefill-0", "pd_orders") - orders == len(outcomes)  # all remote
        rows.append(round(skew))
    print(f"prefill host clock offsets seen (s): {rows}")


def test_6_kv_link_capped(cluster):
    """h2's link at 40 Mbit/s: a prompt's KV (~8 MB) takes seconds, many engine steps;
    transfers finish within their deadline and answers stay exact."""
    c, hosts = cluster, cluster.hosts
    sent = stat(c, "prefill-0", "kv_bytes_sent")
    t = {}

    def fault():
        hosts.rate("h2", "40mbit")
        t["t0"] = time.monotonic()
        time.sleep(8.0)

    try:
        outcomes, failed_over = run_load(c, fault, before_s=0.0)
    finally:
        hosts.unrate("h2")
    moved = stat(c, "prefill-0", "kv_bytes_sent") - sent
    row = report("6 KV link capped at 40 Mbit/s", outcomes, failed_over, wait_idle(c))
    assert row["completed"] == row["sent"] and failed_over == 0
    rate = moved * 8 / (time.monotonic() - t["t0"]) / 1e6
    print(f"KV moved {moved / 1e6:.1f} MB at {rate:.1f} Mbit/s (cap 40)")
    assert moved > 0 and rate < 45  # the cap held: transfers were the slow part
    assert min(o.took_s for o in outcomes) > 0.5


def test_7_ray_worker_host_lost(cluster):
    """Every process on h2 (raylet, actor, prefill node) killed: the launcher reports the
    node lost, and the cluster keeps serving (decode prefills locally)."""
    c, hosts = cluster, cluster.hosts
    killed = hosts.kill_all("h2")
    assert killed
    deadline = time.monotonic() + 60
    while c.service("prefill-0")["state"] != "failed":
        assert time.monotonic() < deadline, c.log("launcher.out")
        time.sleep(0.5)
    said = [ln for ln in c.log("launcher.out").splitlines() if "prefill-0" in ln]
    print("\nlauncher: " + "\n".join(said))
    assert any("cannot be restarted" in ln and "host" in ln for ln in said), said
    assert c.launcher.poll() is None  # the launcher still runs the rest
    with httpx.Client(timeout=CLIENT_DEADLINE_S) as client:
        outcomes = [send(client, c.router_url, r, stream) for r in c.reqs for stream in (0, 1)]
    row = report("7 Ray worker host lost", outcomes, 0, wait_idle(c, names=("decode-0",)))
    assert row["completed"] == row["sent"]

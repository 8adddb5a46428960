"""`launcher: ray`: a 1P1D cluster placed on a local two-raylet Ray cluster serves a request.

The test starts its own Ray cluster on this machine (`ray start --head` plus a second
raylet, each with a custom resource), launches with `pdserve launch`, checks that each
node landed on the raylet offering its group's resource and that a chat request is
answered correctly through the router, then SIGTERMs the launcher and checks that no node process is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.multihost.cluster import ray_cmd
from tests.servers import ROOT, alive, free_port

# Ray's fixed default ports (dashboard agent, ...): one local Ray cluster at a time
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]
pytest.importorskip("nixl")
pytest.importorskip("ray", reason="ray is not installed (pip install 'pdserve[ray]')")


def start_raylet(args: list[str]) -> subprocess.Popen:
    cmd = [*ray_cmd(), "start", "--block", "--disable-usage-stats", *args]
    # Ray's OOM killer judges the whole machine's memory, which other work on a shared CI
    # box fills: it would kill our node actors for memory they do not use.
    env = {**os.environ, "RAY_memory_monitor_refresh_ms": "0"}
    return subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )


def stop_raylet(proc: subprocess.Popen) -> None:
    """Stop `ray start --block` and every process of its group (GCS, raylet, workers)."""
    for sig, wait_s in ((signal.SIGTERM, 3), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: a zombie would keep the group alive
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                proc.wait()
                return
            time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_cluster():
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit
    head = start_raylet(
        ["--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
         "--resources", '{"prefill_host": 1}', "--include-dashboard", "false",
         "--temp-dir", temp]
    )  # fmt: skip
    procs = [head]
    try:
        time.sleep(1)
        address = f"127.0.0.1:{port}"
        second = start_raylet(
            ["--address", address, "--node-ip-address", "127.0.0.1", "--num-cpus", "2",
             "--resources", '{"decode_host": 1}']
        )  # fmt: skip
        procs.append(second)
        yield address
    finally:
        for proc in reversed(procs):
            stop_raylet(proc)
        shutil.rmtree(temp, ignore_errors=True)


CONFIG = """\
cluster: raytest
model: {{name: smollm2-135m-instruct}}
redis: embedded
router: {{port: {router_port}}}
prefill:
  host: auto
  port: {p_port}
  kv_port: {p_kv}
  num_threads: 1
  kv_cache_bytes: 128MiB
  connector: {{kind: nixl}}
  ray: {{num_cpus: 1, resources: {{prefill_host: 1}}}}
decode:
  host: auto
  port: {d_port}
  num_threads: 1
  kv_cache_bytes: 128MiB
  connector: {{kind: nixl}}
  ray: {{num_cpus: 1, resources: {{decode_host: 1}}}}
insecure_open_network: true  # Ray places nodes on the host's address; no secret here
launcher:
  kind: ray
  ray_address: "{address}"
  run_dir: {run_dir}
  log_level: warning
"""


def test_ray_1p1d_serves_and_stops_clean(ray_cluster, tmp_path):
    router_port = free_port()
    config = tmp_path / "ray.yaml"
    config.write_text(
        CONFIG.format(
            router_port=router_port, p_port=free_port(),
            p_kv=free_port(), d_port=free_port(), address=ray_cluster, run_dir=tmp_path / "runs",
        )
    )  # fmt: skip
    state_file = tmp_path / "runs" / "raytest-latest" / "cluster.json"
    out = open(tmp_path / "launcher.out", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "pdserve", "launch", str(config)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert launcher.poll() is None, (tmp_path / "launcher.out").read_text()
            state = json.loads(state_file.read_text()) if state_file.exists() else None
            if state and all(s["state"] == "up" for s in state["services"]):
                break
            assert time.monotonic() < deadline, f"cluster not up: {state}"
            time.sleep(0.5)
        nodes = {s["name"]: s for s in state["services"]}
        # Each node ran on the raylet that offers its group's custom resource.
        assert "prefill_host" in nodes["prefill-0"]["where"]["ray_resources"]
        assert "decode_host" in nodes["decode-0"]["where"]["ray_resources"]
        assert (
            nodes["prefill-0"]["where"]["ray_node_id"] != nodes["decode-0"]["where"]["ray_node_id"]
        )
        url = state["router_url"]
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0, "max_tokens": 20}  # fmt: skip
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
        pids = [s["pid"] for s in state["services"]]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(120) == 0
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)], "node, router or redis processes left"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        out.close()

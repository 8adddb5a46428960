"""`pdserve launch configs/local.yaml` end to end (real SmolLM2, real NIXL, real Redis).

One launch per module (ports moved to free ones with `--set`): a chat request through the
router answers correctly; a node killed with SIGKILL is restarted by the launcher, rejoins
the registry with a new epoch and requests through the router succeed again; SIGTERM to
the launcher leaves no process behind, redis-server included (checked by PID).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from pdserve.common.redis_keys import ClusterKeys
from tests.servers import ROOT, alive, descendants, dies_with_test, free_port

pytestmark = pytest.mark.slow
pytest.importorskip("nixl")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Launch:
    def __init__(self, proc: subprocess.Popen, run_root: Path, output: Path):
        self.proc, self.run_root, self.output = proc, run_root, output

    def state(self) -> dict:
        path = self.run_root / "pdserve-latest" / "cluster.json"
        return json.loads(path.read_text()) if path.exists() else {"services": []}

    def service(self, name: str) -> dict:
        return next(s for s in self.state()["services"] if s["name"] == name)

    def wait(self, ready, what: str, timeout_s: float = 300) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"launcher exited:\n{self.output.read_text()}"
            state = self.state()
            if state["services"] and ready(state):
                return state
            assert time.monotonic() < deadline, f"{what} not in {timeout_s} s: {state}"
            time.sleep(0.5)


def all_up(state: dict) -> bool:
    return all(s["state"] == "up" for s in state["services"])


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    run_root = tmp_path_factory.mktemp("runs")
    keys = ("router.port", "prefill.port", "prefill.kv_port", "decode.port")
    sets = [f"{k}={free_port()}" for k in keys]
    sets += [f"launcher.run_dir={run_root}", "launcher.log_level=warning"]
    sets += ["launcher.restart.backoff_s=0.5"]
    cmd = [sys.executable, "-m", "pdserve", "launch", str(ROOT / "configs" / "local.yaml")]
    for item in sets:
        cmd += ["--set", item]
    output = run_root / "launcher.out"
    with open(output, "wb") as out:
        proc = subprocess.Popen(dies_with_test(cmd), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    launch = Launch(proc, run_root, output)
    t0 = time.monotonic()
    launch.wait(all_up, "cluster up")
    print(f"\ncluster up in {time.monotonic() - t0:.1f} s")
    yield launch
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        for s in launch.state()["services"]:
            if s["pid"] and alive(s["pid"]):
                os.killpg(s["pid"], signal.SIGKILL)


def chat(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=20
    )
    return reply.choices[0].message.content


def registry_epoch(launch: Launch, node: str) -> str | None:
    with redis.Redis.from_url(launch.service("redis")["url"]) as r:
        epoch = r.hget(ClusterKeys().node(node), "epoch")
    return epoch.decode() if epoch else None


def test_chat_through_the_router(launch):
    router = launch.service("router")
    assert router["url"] == launch.state()["router_url"]
    assert chat(router["url"]) == "The capital of France is Paris."
    redis_server = launch.service("redis")
    assert redis_server["url"].startswith("redis://127.0.0.1:") and alive(redis_server["pid"])
    assert registry_epoch(launch, "prefill-0") and registry_epoch(launch, "decode-0")


def test_status_shows_the_cluster_from_redis(launch):
    cmd = [sys.executable, "-m", "pdserve", "status", "--run-dir", str(launch.run_root)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for name in ("redis", "prefill-0", "decode-0", "router"):
        row = next(line for line in lines if line.split()[:1] == [name])
        assert " up " in row and str(launch.service(name)["pid"]) in row
    assert "registry: 2 live node record(s)" in out.stdout
    assert f"OpenAI API: {launch.state()['router_url']}/v1" in out.stdout


def test_killed_node_is_restarted_rejoins_and_serves(launch):
    before = launch.service("decode-0")
    epoch = registry_epoch(launch, "decode-0")
    os.kill(before["pid"], signal.SIGKILL)
    state = launch.wait(
        lambda st: any(
            s["name"] == "decode-0" and s["state"] == "up" and s["pid"] != before["pid"]
            for s in st["services"]
        ),
        "decode-0 restarted",
    )
    after = next(s for s in state["services"] if s["name"] == "decode-0")
    assert after["restarts"] == before["restarts"] + 1
    new_epoch = registry_epoch(launch, "decode-0")
    assert new_epoch is not None and new_epoch != epoch  # re-registered after its restart
    # The router takes it back without anyone telling it (health checks, registry).
    router, deadline = launch.service("router")["url"], time.monotonic() + 120
    while True:
        try:
            assert chat(router) == "The capital of France is Paris."
            break
        except openai.APIError:
            assert time.monotonic() < deadline, "the router never served again"
            time.sleep(1)


def test_sigterm_drains_in_flight_requests_and_leaves_no_process(launch):
    pids = descendants(launch.proc.pid)
    recorded = {s["pid"] for s in launch.state()["services"]}
    assert recorded <= pids and len(recorded) == 4  # redis-server, 2 nodes, router
    assert len(pids) > len(recorded)  # the nodes' engine processes too
    # A request streaming when SIGTERM arrives runs to its end: the router drains first.
    body = {"messages": QUESTION, "temperature": 0, "max_tokens": 64, "ignore_eos": True,
            "stream": True}  # fmt: skip
    events = []
    url = f"{launch.service('router')['url']}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                launch.proc.send_signal(signal.SIGTERM)
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.startswith("The capital of France is Paris.")
    assert launch.proc.wait(120) == 0
    deadline = time.monotonic() + 30
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {left}"
    assert all(s["state"] == "stopped" for s in launch.state()["services"])

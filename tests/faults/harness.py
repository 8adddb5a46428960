"""The fault-drill harness: a launched cluster, steady client load, and the after-checks.

`Cluster` runs `pdserve launch` on a generated config (embedded Redis, router, 2 prefill +
1 decode nodes, a tiny random Llama so drills fit a 2-core box, a cluster secret) and
reads the launcher's cluster.json. `Load` keeps `clients` threads sending completions (streamed or not, shared
prefixes, some disconnecting on purpose) through the routers, each with a hard deadline,
and records every request's outcome. The after-checks: every request ended (complete or a
clear error) within its deadline; every node's `/debug/engine` integrity holds and its
KV blocks in use return to 0 (the idle baseline); the cluster serves again on its own;
the Redis KV index holds sets only of live epochs.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
import yaml

from pdserve.api.cluster_secret import NODE_KEY_HEADER, node_key
from pdserve.common.redis_auth import PASSWORD_ENV, embedded_password
from pdserve.common.redis_keys import ClusterKeys
from tests.servers import ROOT, alive, dies_with_test, free_port, launcher_state

DEADLINE_S = 90.0  # every request must end by then, whatever the drill does
VOCAB = 1000
EXPECTED = {"redis", "prefill-0", "prefill-1", "decode-0", "router"}


@dataclass
class Outcome:
    kind: str  # ok | http_<status> | stream_error | conn_error | disconnected | timeout
    started: float
    ended: float
    router: str
    first_token: float | None = None  # streams: when the first data line came

    @property
    def terminal(self) -> bool:
        """Ended in time, with an answer or a clear error (never silence or a cut stream)."""
        return self.kind not in ("timeout", "truncated") and self.ended - self.started < (
            DEADLINE_S + 5
        )


class Cluster:
    def __init__(self, model_dir: str, run_root: Path, extra: dict | None = None):
        self.run_root = run_root
        secret = os.urandom(24).hex().encode()  # nodes answer only the router; sealed KV frames
        (run_root / "cluster.secret").write_bytes(secret)
        self.node_headers = {NODE_KEY_HEADER: node_key(secret)}
        self.redis_password = embedded_password(secret)  # the embedded Redis wants it
        cfg = {
            "cluster": f"drill{os.getpid()}",
            "model": {"name": model_dir, "block_size": 16},
            "redis": "embedded",
            "secret_file": str(run_root / "cluster.secret"),
            "router": {"port": free_port(), "health_interval_s": 0.5, "max_retries": 2},
            "prefill": {
                "count": 2,
                "port": [free_port(), free_port()],
                "kv_port": [free_port(), free_port()],
                "num_threads": 1,
                "num_blocks": 256,
                "max_num_batched_tokens": 256,
                "connector": {"kind": "nixl", "transfer_timeout_s": 20, "peer_timeout_s": 3},
            },
            "decode": {
                "count": 1,
                "port": free_port(),
                "num_threads": 1,
                "num_blocks": 512,
                "max_num_seqs": 32,
                "connector": {"kind": "nixl", "transfer_timeout_s": 20, "peer_timeout_s": 3},
            },
            "launcher": {
                "run_dir": str(run_root),
                "log_level": "warning",
                "drain_timeout_s": 5,
                "node_ttl_s": 3,
                "restart": {"backoff_s": 0.5, "max_restarts": 20},
            },
        }
        for key, value in (extra or {}).items():
            cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
        self.config = cfg
        self.config_path = run_root / "drill.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.output = run_root / "launcher.out"
        cmd = [sys.executable, "-m", "pdserve", "launch", str(self.config_path)]
        with open(self.output, "wb") as out:
            self.proc = subprocess.Popen(
                dies_with_test(cmd), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )
        self.extra_routers: list[subprocess.Popen] = []

    # -- state ---------------------------------------------------------------------------
    def state(self) -> dict:
        return launcher_state(self.run_root, self.config["cluster"])

    def service(self, name: str) -> dict:
        return next(s for s in self.state()["services"] if s["name"] == name)

    def node_names(self) -> list[str]:
        return [s["name"] for s in self.state()["services"] if s["kind"] in ("prefill", "decode")]

    def wait_up(self, timeout_s: float = 300, names: set[str] = EXPECTED) -> None:
        """Every service up, `names` among them (the launcher restarts a killed one)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"launcher exited:\n{self.output.read_text()}"
            services = self.state()["services"]
            if {s["name"] for s in services} >= names and all(s["state"] == "up" for s in services):
                return
            assert time.monotonic() < deadline, f"cluster not up in {timeout_s} s: {services}"
            time.sleep(0.5)

    def diagnosis(self, lines: int = 60) -> str:
        """The launcher's view of every service and the last lines of each process's log,
        after each node and router wrote where its threads and tasks are (SIGUSR1,
        pdserve/common/stack_dump.py): what a failed drill prints, so a failure on CI
        (whose temporary files are gone once it ends) can be read from its output."""
        out = []
        try:
            services = self.state()["services"]
            out.append(f"services: {services}")
        except Exception as e:  # the launcher's state file may be what broke
            services = []
            out.append(f"services: unreadable ({e!r})")
        for svc in services:
            up = svc["state"] == "up" and svc.get("pid") and alive(svc["pid"])
            if up and svc["kind"] != "redis":  # (before its handler is set, USR1 kills)
                with contextlib.suppress(OSError):
                    os.kill(svc["pid"], signal.SIGUSR1)
        time.sleep(1.0)
        runs = sorted(p for p in self.run_root.iterdir() if p.is_dir() and p.name[-1].isdigit())
        logs = sorted(runs[-1].glob("*.log")) if runs else []
        for log in [self.output, *logs]:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(out)

    @property
    def router_url(self) -> str:
        return self.service("router")["url"]

    def start_extra_router(self) -> str:
        """A second router replica on the same Redis registry (its own port)."""
        port = free_port()
        r = self.service("redis")
        cmd = [sys.executable, "-m", "pdserve", "router", "--port", str(port)]
        cmd += ["--model", self.config["model"]["name"], "--redis-url", r["url"]]
        cmd += ["--cluster", self.config["cluster"], "--log-level", "warning"]
        cmd += ["--health-interval-s", "0.5", "--max-retries", "2"]
        cmd += ["--cluster-secret-file", self.config["secret_file"]]
        log = open(self.run_root / f"router-extra-{port}.log", "wb")
        env = {**os.environ, PASSWORD_ENV: self.redis_password}
        proc = subprocess.Popen(
            dies_with_test(cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
        )
        self.extra_routers.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_serving(url, 120)
        return url

    def stop(self) -> None:
        for p in self.extra_routers:
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for s in self.state()["services"]:
            if s.get("pid") and alive(s["pid"]):
                os.killpg(s["pid"], signal.SIGKILL)

    # -- after-checks --------------------------------------------------------------------
    def engines(self) -> dict[str, dict]:
        out = {}
        for s in self.state()["services"]:
            if s["kind"] in ("prefill", "decode"):
                url = f"{s['url']}/debug/engine"
                out[s["name"]] = httpx.get(url, headers=self.node_headers, timeout=30).json()
        return out

    def wait_blocks_idle(self, timeout_s: float = 90) -> dict[str, int]:
        """Until every node holds 0 KV blocks and runs nothing; integrity checked each time.
        Returns blocks in use per node at the end (all 0, or the assert fires)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                engines = self.engines()
            except httpx.HTTPError:
                engines = None
            if engines is not None:
                for name, e in engines.items():
                    assert e["integrity"]["ok"], f"{name}: {e['integrity']['error']}"
                used = {n: e["stats"]["kv_blocks_used"] for n, e in engines.items()}
                busy = sum(e["stats"]["num_running"] + e["stats"]["num_waiting"]
                           for e in engines.values())  # fmt: skip
                if busy == 0 and not any(used.values()):
                    return used
            assert time.monotonic() < deadline, f"blocks not back to idle: {engines}"
            time.sleep(0.5)

    def wait_no_dead_epochs(self, timeout_s: float = 30) -> None:
        """The KV index holds sets only of the epochs the registry lists as live."""
        keys = ClusterKeys(self.config["cluster"])
        deadline = time.monotonic() + timeout_s
        while True:
            url, password = self.service("redis")["url"], self.redis_password
            with redis.Redis.from_url(url, password=password, socket_timeout=5) as r:
                live = {}
                for node_id in r.smembers(keys.nodes):
                    epoch = r.hget(keys.node(node_id.decode()), "epoch")
                    if epoch:
                        live[node_id.decode()] = epoch.decode()
                stale = []
                for key in r.scan_iter(keys.kv_pattern):
                    node_id, epoch = key.decode().rsplit(":", 2)[-2:]
                    if live.get(node_id) != epoch:
                        stale.append(key.decode())
            if not stale:
                return
            assert time.monotonic() < deadline, f"dead epochs in the KV index: {stale}"
            time.sleep(0.5)


def completion_body(rng: random.Random, prefixes: list[list[int]]) -> dict:
    prompt = rng.choice(prefixes) + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 60))]
    return {"prompt": prompt, "max_tokens": rng.randrange(4, 24), "temperature": 0,
            "ignore_eos": True, "stream": rng.random() < 0.5}  # fmt: skip


def one_request(client: httpx.Client, router: str, body: dict, disconnect_after: int | None):
    """Send one completion and classify how it ended (never waits past DEADLINE_S)."""
    t0 = time.monotonic()
    kind, first = "ok", None
    try:
        if not body["stream"]:
            r = client.post(f"{router}/v1/completions", json=body)
            kind = "ok" if r.status_code == 200 else f"http_{r.status_code}"
            if r.status_code >= 400:
                assert r.json()["error"]["message"]  # a clear error, OpenAI-style
        else:
            with client.stream("POST", f"{router}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    kind = f"http_{r.status_code}"
                elif disconnect_after is not None and disconnect_after < 0:
                    kind = "disconnected"  # right after the headers, before any token
                else:
                    kind = "truncated"
                    for i, line in enumerate(r.iter_lines()):
                        if time.monotonic() - t0 > DEADLINE_S:
                            kind = "timeout"
                            break
                        if disconnect_after is not None and i >= disconnect_after:
                            kind = "disconnected"
                            break
                        if first is None and line.startswith("data: "):
                            first = time.monotonic()
                        if line.startswith("data: ") and '"error"' in line:
                            kind = "stream_error"
                        elif line == "data: [DONE]":
                            kind = "ok" if kind != "stream_error" else kind
                            break
    except httpx.TimeoutException:
        kind = "timeout"
    except httpx.TransportError:
        kind = "conn_error"
    return Outcome(kind, t0, time.monotonic(), router, first)


@dataclass
class Load:
    """`clients` threads sending requests round the routers until `stop()`."""

    routers: list[str]
    clients: int = 4
    disconnect_rate: float = 0.0  # share of streams closed by the client early
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for i in range(self.clients):
            t = threading.Thread(target=self._run, args=(self.seed * 100 + i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        prefixes = [[rng.randrange(3, VOCAB) for _ in range(48)] for _ in range(3)]
        timeout = httpx.Timeout(DEADLINE_S, connect=5)
        with httpx.Client(timeout=timeout) as client:
            while not self._stop.is_set():
                body = completion_body(rng, prefixes)
                cut = None
                if body["stream"] and rng.random() < self.disconnect_rate:
                    cut = rng.choice([-1, 1, 3])  # before the first token, or mid-stream
                router = rng.choice(self.routers)
                out = one_request(client, router, body, cut)
                self.outcomes.append(out)
                if out.kind == "conn_error" and len(self.routers) > 1:
                    # a client of a dead replica tries another (what a load balancer does)
                    others = [r for r in self.routers if r != router]
                    self.outcomes.append(one_request(client, rng.choice(others), body, cut))
                if out.kind != "ok":
                    time.sleep(0.2)

    def stop(self, timeout_s: float = DEADLINE_S + 30) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self._threads), "a client is still waiting"

    def summary(self, since: float = 0.0) -> dict[str, int]:
        counts: dict[str, int] = {}
        for o in self.outcomes:
            if o.started >= since:
                counts[o.kind] = counts.get(o.kind, 0) + 1
        return counts


def serves(url: str) -> bool:
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    try:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def wait_serving(url: str, timeout_s: float, streak: int = 3) -> float:
    """Seconds until `url` answers `streak` requests in a row; asserts within `timeout_s`."""
    t0 = time.monotonic()
    ok = 0
    while ok < streak:
        assert time.monotonic() - t0 < timeout_s, f"{url} not serving in {timeout_s} s"
        ok = ok + 1 if serves(url) else 0
        if ok == 0:
            time.sleep(0.3)
    return time.monotonic() - t0

"""Trust at the host boundary, on one launched cluster with a secret (`pdserve launch`: the
embedded redis-server with its derived password, a decode node with the tiny random Llama,
the router with an API key; real processes, real HTTP), attacked as someone on its network
who can reach Redis and the ports would:

* Redis wants the password (derived from the secret, given to processes by environment);
* a forged registry record (HSET + SADD, unsigned or wrongly signed, `vocab_size 1`, a url
  of the attacker's) is ignored by the router and flagged by `pdserve status`: the
  attacker's listener never sees a request or the node key, and prompts still pass;
* `/cluster`, `/metrics` and `/debug/` want the API key (router) or node key (node), and
  show no password; no secret is in any process's argv, any log, cluster.json or status;
* without an API key, a client rotating `Authorization: Bearer <random>` is still one
  client (its address) for the per-key token bucket.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from pdserve.cluster.registry import NodeRecord
from pdserve.common.cluster_secret import NODE_KEY_HEADER, node_key
from pdserve.common.redis_auth import PASSWORD_ENV, embedded_password
from pdserve.common.redis_keys import ClusterKeys
from tests.servers import (
    ROOT,
    alive,
    dies_with_test,
    free_port,
    kill_server,
    launch_server,
    wait_healthy,
)

SECRET = b"trust-test-secret-0123456789abcdef"
API_KEY = "sk-trust-test-key"
KEYS = ClusterKeys("trust")
AUTH = {"Authorization": f"Bearer {API_KEY}"}

CONFIG = """\
cluster: trust
model: {{name: {model}, served_name: tiny, dtype: float32, block_size: 16}}
redis: embedded
router: {{host: 127.0.0.1, port: {router_port}, api_key: {api_key}}}
decode:
  count: 1
  host: 127.0.0.1
  port: {decode_port}
  num_threads: 1
  kv_cache_bytes: 16MiB
secret_file: {secret_file}
launcher:
  run_dir: {run_dir}
  log_level: info
  startup_timeout_s: 240
  heartbeat_s: 0.3
  node_ttl_s: 1.5
"""


class Cluster:
    def __init__(self, proc: subprocess.Popen, tmp: Path, out: Path):
        self.proc, self.tmp, self.out = proc, tmp, out
        self.run_dir = tmp / "runs" / "trust-latest"

    def state(self) -> dict:
        import json

        path = self.run_dir / "cluster.json"
        return json.loads(path.read_text()) if path.exists() else {"services": []}

    def service(self, name: str) -> dict:
        return next(s for s in self.state()["services"] if s["name"] == name)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.service("redis")["url"], password=PASSWORD)


PASSWORD = embedded_password(SECRET)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("trust")
    model = tiny_llama_dir
    secret_file = tmp / "cluster.secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    config = tmp / "cluster.yaml"
    config.write_text(
        CONFIG.format(
            model=model,
            router_port=free_port(),
            decode_port=free_port(),
            api_key=API_KEY,
            secret_file=secret_file,
            run_dir=tmp / "runs",
        )
    )
    out = tmp / "launcher.out"
    kept = ("PDSERVE_HUGEPAGES", "PDSERVE_KV_POPULATE")  # the test run's memory settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_") or k in kept}
    with open(out, "wb") as f:
        cmd = [sys.executable, "-m", "pdserve", "launch", str(config)]
        proc = subprocess.Popen(
            dies_with_test(cmd), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env
        )
    c = Cluster(proc, tmp, out)
    c.model = model
    try:
        deadline = time.monotonic() + 240
        while not (
            c.state()["services"] and all(s["state"] == "up" for s in c.state()["services"])
        ):
            assert proc.poll() is None, f"launcher exited:\n{out.read_text()}"
            assert time.monotonic() < deadline, f"cluster not up: {c.state()}"
            time.sleep(0.3)
        yield c
    finally:
        services = c.state()["services"]
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for s in services:
            if s["pid"] and alive(s["pid"]):
                os.killpg(s["pid"], 9)


def complete(router: str, prompt: list[int], headers: dict, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    return httpx.post(f"{router}/v1/completions", json=body, headers=headers, timeout=60)


def test_redis_wants_the_password_and_the_config_file_is_owner_only(cluster):
    url = cluster.service("redis")["url"]
    assert "@" not in url
    with pytest.raises(redis.AuthenticationError), redis.Redis.from_url(url) as r:
        r.ping()
    with pytest.raises(redis.AuthenticationError), redis.Redis.from_url(url, password="x") as r:
        r.ping()
    with cluster.redis() as r:
        assert r.ping()
        assert r.sismember(KEYS.nodes, "decode-0")  # the node got in, by its environment
    conf = cluster.run_dir / "redis.conf"
    assert conf.stat().st_mode & 0o077 == 0


class Listener:
    """The attacker's HTTP endpoint: records whatever connects (and answers nothing)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(1.0)
            try:
                self.received.append(conn.recv(65536))
            except OSError:
                self.received.append(b"(connected)")
            conn.close()


def forge(r: redis.Redis, node_id: str, url: str, sig: str | None) -> None:
    rec = NodeRecord(node_id=node_id, role="colocated", url=url, model="tiny", block_size=16,
                     epoch=1, max_model_len=8, vocab_size=1, updated=time.time())  # fmt: skip
    fields = rec.to_redis()
    if sig is not None:
        fields["sig"] = sig
    r.hset(KEYS.node(node_id), mapping=fields)
    r.expire(KEYS.node(node_id), 60)
    r.sadd(KEYS.nodes, node_id)


def test_forged_registry_records_are_ignored(cluster):
    router = cluster.service("router")["url"]
    evil = Listener()
    try:
        with cluster.redis() as r:
            forge(r, "evil", f"http://127.0.0.1:{evil.port}", None)
            forge(r, "evil2", f"http://127.0.0.1:{evil.port}", "00" * 32)
            # the real node's signed record copied under another id is refused too
            r.hset(KEYS.node("evil3"), mapping=r.hgetall(KEYS.node("decode-0")))
            r.sadd(KEYS.nodes, "evil3")
        time.sleep(2.0)  # four registry reads and health-probe rounds
        view = httpx.get(f"{router}/cluster", headers=AUTH, timeout=10).json()
        urls = [n["url"] for n in view["nodes"]]
        assert urls == [cluster.service("decode-0")["url"]], view
        # vocab_size 1 / max_model_len 8 in the forged records would refuse these
        resp = complete(router, [5, 900, 17, 300, 44, 12, 600, 7, 8, 9], AUTH)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 2
        assert evil.received == []
        # the decode node, which reads the registry for prefill nodes, refused them too
        decode_log = (cluster.run_dir / "decode-0.log").read_text()
        assert "ignoring node evil: unsigned record" in decode_log
        assert "ignoring node evil2: bad signature" in decode_log
        status = subprocess.run(
            [sys.executable, "-m", "pdserve", "status", "--run-dir", str(cluster.tmp / "runs")],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={**os.environ, "PDSERVE_CLUSTER_SECRET_FILE": str(cluster.tmp / "cluster.secret")},
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        lines = {ln.split()[0]: ln for ln in status.stdout.splitlines() if ln.startswith("  ")}
        assert "IGNORED: unsigned record" in lines["evil"]
        assert "IGNORED: bad signature" in lines["evil2"]
        assert "IGNORED: record filed under another node's id" in lines["evil3"]
        assert "IGNORED" not in lines["decode-0"]
        cluster.status_output = status.stdout + status.stderr
    finally:
        evil.sock.close()
        with cluster.redis() as r:
            r.delete(*(KEYS.node(n) for n in ("evil", "evil2", "evil3")))
            r.srem(KEYS.nodes, "evil", "evil2", "evil3")


def test_cluster_views_want_the_key_and_show_no_password(cluster):
    router = cluster.service("router")["url"]
    node = cluster.service("decode-0")["url"]
    for path in ("/cluster", "/metrics", "/v1/models"):
        assert httpx.get(f"{router}{path}", timeout=10).status_code == 401, path
        bad = {"Authorization": "Bearer nope"}
        assert httpx.get(f"{router}{path}", headers=bad, timeout=10).status_code == 401, path
        ok = httpx.get(f"{router}{path}", headers=AUTH, timeout=10)
        assert ok.status_code == 200 and PASSWORD not in ok.text, path
    assert httpx.get(f"{router}/health", timeout=10).status_code == 200
    assert httpx.get(f"{router}/cluster", headers=AUTH, timeout=10).json()["redis"]["up"]
    for path in ("/metrics", "/debug/engine", "/v1/node"):
        assert httpx.get(f"{node}{path}", timeout=10).status_code == 401, path
        key = {NODE_KEY_HEADER: node_key(SECRET)}
        assert httpx.get(f"{node}{path}", headers=key, timeout=10).status_code == 200, path


def test_no_secret_in_argv_logs_cluster_json_or_status(cluster):
    secrets = [SECRET.decode(), PASSWORD, node_key(SECRET), API_KEY]
    pids = [cluster.proc.pid] + [s["pid"] for s in cluster.state()["services"]]
    for pid in pids:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert not any(s in argv for s in secrets), argv
    texts = {p.name: p.read_text(errors="replace") for p in cluster.run_dir.glob("*.log")}
    texts["cluster.json"] = (cluster.run_dir / "cluster.json").read_text()
    texts["launcher.out"] = cluster.out.read_text()
    texts["status"] = getattr(cluster, "status_output", "")
    with cluster.redis() as r:
        texts["redis launcher key"] = (r.get(KEYS.launcher) or b"").decode()
    assert {"router.log", "decode-0.log", "redis.log", "launcher.log"} <= texts.keys()
    for name, text in texts.items():
        assert not any(s in text for s in secrets), name


@pytest.fixture(scope="module")
def open_router(cluster):
    """A second router on the same cluster, without an API key: limits and the per-client
    cache salt go by client address."""
    redis_url = cluster.service("redis")["url"]
    args = ["--model", cluster.model, "--served-model-name", "tiny",
            "--redis-url", redis_url, "--cluster", "trust", "--log-level", "warning",
            "--cluster-secret-file", str(cluster.tmp / "cluster.secret"),
            "--prompt-tokens-per-minute-per-key", "100", "--cache-salt-per-client"]  # fmt: skip
    env_before = os.environ.get(PASSWORD_ENV)
    os.environ[PASSWORD_ENV] = PASSWORD  # the router's environment: how it gets in
    try:
        url, proc = launch_server(args, free_port(), "router")
    finally:
        if env_before is None:
            os.environ.pop(PASSWORD_ENV)
        else:
            os.environ[PASSWORD_ENV] = env_before
    try:
        wait_healthy(url, proc, timeout_s=120)
        yield url
    finally:
        kill_server(proc)


def from_address(url: str, address: str, prompt: list[int], headers: dict | None = None):
    transport = httpx.HTTPTransport(local_address=address)
    with httpx.Client(transport=transport, timeout=60) as c:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        return c.post(f"{url}/v1/completions", json=body, headers=headers or {})


def test_rotating_bearer_tokens_share_one_budget(open_router):
    """Without an API key, limits are per client address, whatever header it sends."""
    codes = []
    for i in range(5):
        headers = {"Authorization": f"Bearer {os.urandom(8).hex()}"}
        prompt = list(range(10 + i, 40 + i))  # 30 tokens: 3 fit in 100
        codes.append(from_address(open_router, "127.0.0.1", prompt, headers).status_code)
    assert codes == [200, 200, 200, 429, 429], codes


def test_per_client_salt_hides_one_clients_prompts_from_another(open_router):
    prompt = [(41 * i + 3) % 1000 for i in range(36)]  # 2 full blocks

    def cached(address: str) -> int:
        resp = from_address(open_router, address, prompt)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("127.0.0.3") == 0
    assert cached("127.0.0.4") == 0  # another client: nothing to detect
    assert cached("127.0.0.3") == 32  # its own prompt still hits


def test_cache_salt_keeps_tenants_prefix_hits_apart(cluster):
    """A prompt cached under one `cache_salt` is invisible to another salt (and to no salt):
    `cached_tokens` is 0 for them, and the same salt still hits."""
    router = cluster.service("router")["url"]
    prompt = [(37 * i + 11) % 1000 for i in range(50)]  # 3 full blocks of 16

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        resp = complete(router, prompt, AUTH, **extra)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0  # first sight
    assert cached("tenant-b") == 0  # another tenant probing the same prompt learns nothing
    assert cached(None) == 0
    assert cached("tenant-a") == 48  # the tenant's own hits stay
    resp = complete(router, prompt, AUTH, cache_salt="x" * 257)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt"

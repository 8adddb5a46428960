"""`rediss://`: a router process reaches a TLS redis-server (started here with a fresh
self-signed certificate and a password) and follows its registry, signed records only.

* plain TCP and a TLS client that does not trust the certificate get nothing;
* the router (password by environment, CA in the URL's `ssl_ca_certs`) reads the registry:
  a record signed with the cluster secret on an allowed host (the static nodes' or one
  named by `--node-hosts`) joins its view; an unsigned one, and a signed one naming
  another host, do not.
"""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import pytest
import redis

from pdserve.cluster.registry import NodeRecord
from pdserve.common.redis_auth import PASSWORD_ENV
from pdserve.common.redis_keys import ClusterKeys
from tests.servers import free_port, kill_server, launch_server
from tests.test_router_token_limits import _self_signed

SECRET = b"tls-test-cluster-secret-0123456789"
PASSWORD = "tls-test-redis-password"
KEYS = ClusterKeys("tls")


@pytest.fixture
def tls_redis(tmp_path):
    cert, key = _self_signed(tmp_path)
    port = free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text(f'requirepass "{PASSWORD}"\n')
    conf.chmod(0o600)
    cmd = ["redis-server", str(conf), "--port", "0", "--tls-port", str(port),
           "--bind", "127.0.0.1", "--tls-cert-file", cert, "--tls-key-file", key,
           "--tls-ca-cert-file", cert, "--tls-auth-clients", "no", "--save", "",
           "--appendonly", "no", "--dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"rediss://127.0.0.1:{port}?ssl_ca_certs={cert}"
    deadline = time.monotonic() + 20
    while True:
        try:
            with redis.Redis.from_url(url, password=PASSWORD, socket_timeout=1) as r:
                r.ping()
            break
        except redis.ConnectionError:
            assert proc.poll() is None and time.monotonic() < deadline, "no TLS redis-server"
            time.sleep(0.1)
    yield url, port
    proc.terminate()
    proc.wait(10)


def record(node_id: str, url: str) -> NodeRecord:
    return NodeRecord(node_id=node_id, role="decode", url=url, model="tiny", block_size=16,
                      epoch=1, max_model_len=512, vocab_size=1024)  # fmt: skip


def test_router_follows_a_tls_registry_with_signed_records_only(tls_redis, tiny_llama_dir):
    url, port = tls_redis
    with pytest.raises(redis.ConnectionError), redis.Redis(port=port, socket_timeout=1) as r:
        r.ping()  # plain TCP to the TLS port
    with pytest.raises(redis.ConnectionError):
        with redis.Redis.from_url(f"rediss://127.0.0.1:{port}", password=PASSWORD) as r:
            r.ping()  # a client that does not trust the certificate
    good, off_host, unsigned = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
    listed = f"http://127.0.0.2:{free_port()}"  # a host named by --node-hosts
    with redis.Redis.from_url(url, password=PASSWORD) as r:
        for node_id, rec, secret in (
            ("good", record("good", good), SECRET),
            ("far", record("far", "http://localhost:9"), SECRET),  # signed, host not allowed
            ("listed", record("listed", listed), SECRET),
            ("evil", record("evil", unsigned), None),
        ):
            r.hset(KEYS.node(node_id), mapping=rec.to_redis(secret))
            r.expire(KEYS.node(node_id), 120)
            r.sadd(KEYS.nodes, node_id)
    args = ["--model", tiny_llama_dir, "--served-model-name", "tiny", "--redis-url", url,
            "--cluster", "tls", "--decode", off_host, "--log-level", "warning",
            "--node-hosts", "127.0.0.2"]  # fmt: skip
    os.environ[PASSWORD_ENV] = PASSWORD  # the router's environment carries the password
    secret_env = {"PDSERVE_CLUSTER_SECRET": SECRET.decode()}
    os.environ.update(secret_env)
    try:
        router, proc = launch_server(args, free_port(), "router")
    finally:
        os.environ.pop(PASSWORD_ENV)
        os.environ.pop("PDSERVE_CLUSTER_SECRET")
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "router exited"
            assert time.monotonic() < deadline, "router never read the registry"
            try:
                view = httpx.get(f"{router}/cluster", timeout=5).json()
                if view["redis"]["up"] and len(view["nodes"]) > 2:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        time.sleep(1.0)  # two more registry reads
        view = httpx.get(f"{router}/cluster", timeout=5).json()
        assert sorted(n["url"] for n in view["nodes"]) == sorted([good, off_host, listed]), view
        assert PASSWORD not in str(view) and view["redis"]["url"].startswith("rediss://")
    finally:
        kill_server(proc)

"""Cluster security on a real 1P1D pair (SmolLM2, real NIXL, real HTTP) with a secret.

* every socket either node's processes listen on is on loopback (HTTP, engine, KV control
  and the NIXL/UCX data plane, which UCX would otherwise open on every interface);
* a node's HTTP API answers only requests carrying the router's node key (401 otherwise,
  `/health` stays open);
* the KV control channel is encrypted (CurveZMQ, keys derived from the secret): a client
  without the derived key gets no connection at all;
* on the KV control port, garbage, unsigned, wrongly signed, replayed and stale frames are
  dropped unanswered, while a sealed heartbeat is answered, and the pair keeps serving.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import zmq

from pdserve.api.cluster_secret import NODE_KEY_HEADER, node_key
from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.control_channel import curve_server_keys
from pdserve.kv_transfer.frame_auth import FrameAuth
from tests.servers import ROOT, descendants, free_port, kill_server, wait_healthy

pytestmark = pytest.mark.slow
pytest.importorskip("nixl")

SECRET = b"test-cluster-secret-0123456789"
COMMON = ["--model", "smollm2-135m-instruct", "--kv-cache-bytes", str(64 << 20)]
COMMON += ["--num-threads", "1", "--log-level", "warning"]


def start(args: list[str], secret_file: str) -> tuple[str, subprocess.Popen]:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--port", str(port), *COMMON, *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    proc = subprocess.Popen([*cmd, "--cluster-secret-file", secret_file], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return url, proc


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    secret_file = tmp_path_factory.mktemp("secret") / "cluster.secret"
    secret_file.write_bytes(SECRET + b"\n")
    ctl = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    try:
        p_url, p = start(["--role", "prefill", "--kv-control", ctl], str(secret_file))
        procs.append(p)
        d_url, d = start(["--role", "decode", "--prefill-node", ctl], str(secret_file))
        procs.append(d)
        yield {"prefill": p_url, "decode": d_url, "ctl": ctl, "procs": procs}
    finally:
        for p in procs:
            kill_server(p)


HEADERS = {NODE_KEY_HEADER: node_key(SECRET)}


def complete(url: str, prompt: str = "The capital of France is") -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=300)


def listeners(pids: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if any(f"pid={pid}," in line for pid in pids):
            found.append(line.split()[3])
    return found


def test_every_listening_socket_is_on_loopback(pair):
    assert complete(pair["decode"]).status_code == 200  # the data plane has been used
    pids = set()
    for p in pair["procs"]:
        pids |= {p.pid} | descendants(p.pid)
    addrs = listeners(pids)
    # HTTP x2, KV control, a UCX listener per NIXL agent (x2) at least
    assert len(addrs) >= 5, addrs
    outside = [a for a in addrs if not a.startswith(("127.", "[::1]"))]
    assert outside == [], f"listening beyond loopback: {outside} (all: {addrs})"


def test_node_http_answers_only_the_router(pair):
    for url in (pair["prefill"], pair["decode"]):
        body = {"prompt": "hi", "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_node_key"
        wrong = {NODE_KEY_HEADER: node_key(b"another secret of 16+ bytes")}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=wrong, timeout=30)
        assert r.status_code == 401
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert complete(pair["decode"]).json()["usage"]["completion_tokens"] == 8


def dealer(ctx: zmq.Context, address: str, server_key: bytes | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:  # CurveZMQ, as a decode node connects
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(address)
    return sock


def test_control_channel_is_encrypted(pair):
    """Without the CURVE key derived from the secret, a client gets no connection: even a
    correctly sealed heartbeat (the MAC alone would pass) is never answered; with it, the
    same heartbeat is answered."""
    ctx = zmq.Context()
    server_key = curve_server_keys(FrameAuth(SECRET))[0]
    wrong_key = curve_server_keys(FrameAuth(b"not the cluster secret at all"))[0]
    socks = [dealer(ctx, pair["ctl"], k) for k in (None, wrong_key, server_key)]
    try:
        for sock in socks:
            sock.send(FrameAuth(SECRET).seal(m.encode(m.Heartbeat(seq=1))))
        assert socks[2].poll(60_000), "the CURVE client with the derived key got no answer"
        reply = FrameAuth(SECRET).open(socks[2].recv())
        assert m.decode_to_decode(reply).seq == 1  # a HeartbeatAck
        assert not socks[0].poll(2000) and not socks[1].poll(100)
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


def test_forged_and_replayed_control_frames_are_dropped(pair):
    """An insider that passes the CURVE handshake still needs the MAC of the secret."""
    ctx = zmq.Context()
    sock = dealer(ctx, pair["ctl"], curve_server_keys(FrameAuth(SECRET))[0])

    def answered(frame: bytes, wait_s: float) -> bytes | None:
        sock.send(frame)
        return sock.recv() if sock.poll(int(wait_s * 1000)) else None

    good = FrameAuth(SECRET)
    order = m.PrefillOrder(
        request_id="forged",
        attempt=0,
        prompt_token_ids=list(range(1, 40)),
        params=m.SamplingParams(),
        decode_agent="stranger",
        first_block=0,
        dst_block_ids=[0, 1, 2],
        ttl_s=60.0,
    )
    abort = m.AbortPrefill(request_id="forged", attempt=0, ttl_s=60.0)
    try:
        # A sealed heartbeat from a holder of the secret is answered (a sealed ack) ...
        sealed = good.seal(m.encode(m.Heartbeat(seq=1)))
        reply = answered(sealed, 60)
        assert reply is not None
        assert m.decode_to_decode(FrameAuth(SECRET).open(reply)).seq == 1
        # ... but the same bytes again (a replay) are not; nor is anything unsealed,
        # sealed with another secret, tampered, or garbage.
        stranger = FrameAuth(b"not the cluster secret at all")
        tampered = bytearray(good.seal(m.encode(order)))
        tampered[-1] ^= 0x01  # one bit of the payload flipped after sealing
        tampered = bytes(tampered)
        hostile = [
            sealed,
            m.encode(m.Heartbeat(seq=2)),
            m.encode(order),
            m.encode(abort),
            stranger.seal(m.encode(order)),
            tampered,
            b"\x00" * 100,
            os.urandom(5000),
            b"",
        ]
        for frame in hostile:
            assert answered(frame, 1.0) is None, frame[:40]
        sock.send_multipart([b"a", b"b", b"c"])  # extra frames: dropped too
        # still alive, still answering its own cluster
        assert answered(good.seal(m.encode(m.Heartbeat(seq=4))), 60) is not None
    finally:
        sock.close(linger=0)
        ctx.term()
    assert complete(pair["decode"]).status_code == 200
    for url in (pair["prefill"], pair["decode"]):
        httpx_get = httpx.get(f"{url}/debug/engine", headers=HEADERS, timeout=30)
        assert httpx_get.json()["integrity"]["ok"] is True
    wait_idle_with_key(pair["decode"])


def wait_idle_with_key(url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        stats = httpx.get(f"{url}/debug/engine", headers=HEADERS, timeout=30).json()["stats"]
        if stats["num_running"] + stats["num_waiting"] + stats["kv_blocks_used"] == 0:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)

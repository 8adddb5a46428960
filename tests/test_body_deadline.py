"""The whole-body read deadline (`--body-timeout-s`, api/body_deadline.py): a client that
sends the headers and part of the body, then stalls, gets a 408 with the OpenAI-style
`body_timeout` error once the deadline has passed and its connection is closed; on a node
and on the router (its lean path and the FastAPI fallback: a non-JSON content type, a
chunked body). A slow body that finishes in time is served; the server answers others
meanwhile. Real node, real router, raw sockets.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.servers import kill_server, start_server

DEADLINE_S = 2.0
MARGIN_S = 20.0  # generous: the machine may be busy
NODE_ARGS = ["--num-threads", "1", "--log-level", "warning", "--num-blocks", "64"]
BODY = json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0}).encode()


@pytest.fixture(scope="module")
def node(tiny_llama_dir):
    url, proc = start_server(
        ["--model", tiny_llama_dir, *NODE_ARGS, "--body-timeout-s", str(DEADLINE_S)]
    )
    yield url
    kill_server(proc)


@pytest.fixture(scope="module")
def router(node, tiny_llama_dir):
    url, proc = start_server(
        ["--model", tiny_llama_dir, "--decode", node, "--body-timeout-s", str(DEADLINE_S),
         "--health-interval-s", "60", "--log-level", "warning"],
        command="router",
    )  # fmt: skip
    yield url
    kill_server(proc)


def connect(url: str) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=DEADLINE_S + MARGIN_S)


def headers(path: str, ctype: str, length: int | None) -> bytes:
    """Request headers (Connection: close: the server closes after its answer)."""
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n{framing}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """Status, headers and body; reads until the server closes the connection (asserts
    that it does, within the socket's timeout)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in fields.items()}, body


CASES = {
    "json": ("application/json", True),  # the router's lean path
    "text/plain": ("text/plain", True),  # the router's FastAPI fallback
    "chunked": ("application/json", False),  # FastAPI fallback too
}


def stall(url: str, case: str) -> tuple[float, int, dict, bytes]:
    """Send headers and half a body, then nothing; the 408 response and its delay."""
    ctype, with_length = CASES[case]
    sock = connect(url)
    try:
        half = BODY[: len(BODY) // 2]
        sent = half if with_length else f"{len(half):x}\r\n".encode() + half + b"\r\n"
        t0 = time.monotonic()
        sock.sendall(headers("/v1/completions", ctype, len(BODY) if with_length else None))
        sock.sendall(sent)
        status, hdrs, body = read_response(sock)
        return time.monotonic() - t0, status, hdrs, body
    finally:
        sock.close()


def assert_body_timeout(elapsed: float, status: int, body: bytes) -> dict:
    assert status == 408, body
    assert DEADLINE_S * 0.9 <= elapsed < DEADLINE_S + MARGIN_S, elapsed
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "body_timeout"
    assert f"{DEADLINE_S:g} s" in err["message"]
    return err


@pytest.mark.parametrize("case", list(CASES))
def test_stalled_body_gets_408_node_and_router_alike(node, router, case):
    errors = []
    for url in (node, router):
        elapsed, status, hdrs, body = stall(url, case)
        errors.append(assert_body_timeout(elapsed, status, body))
        assert hdrs.get("connection") == "close"
    assert errors[0] == errors[1]  # the router's body is the node's


def test_others_are_served_while_a_body_stalls(node, router):
    for url in (node, router):
        ctype, _ = CASES["json"]
        sock = connect(url)
        try:
            sock.sendall(headers("/v1/completions", ctype, len(BODY)) + BODY[:5])
            t0 = time.monotonic()
            r = httpx.post(f"{url}/v1/completions", content=BODY, timeout=120,
                           headers={"content-type": "application/json"})  # fmt: skip
            assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
            status, _, body = read_response(sock)
            assert status == 408, body
            assert time.monotonic() - t0 < DEADLINE_S + MARGIN_S
        finally:
            sock.close()


@pytest.mark.parametrize("case", ["json", "chunked"])
def test_slow_body_within_the_deadline_is_served(node, router, case):
    ctype, with_length = CASES[case]
    pieces = [BODY[i : i + 12] for i in range(0, len(BODY), 12)][:4]
    pieces[-1] += BODY[sum(map(len, pieces)) :]
    for url in (node, router):
        sock = connect(url)
        try:
            sock.sendall(headers("/v1/completions", ctype, len(BODY) if with_length else None))
            for piece in pieces:
                time.sleep(DEADLINE_S / 4 / len(pieces))
                chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
                sock.sendall(piece if with_length else chunk)
            if not with_length:
                sock.sendall(b"0\r\n\r\n")
            status, _, body = read_response(sock)
            assert status == 200, body
            assert json.loads(body)["usage"]["completion_tokens"] == 2
        finally:
            sock.close()


@pytest.mark.parametrize("command", ["serve", "router"])
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_bad_body_timeout_is_a_config_error_naming_the_flag(tiny_llama_dir, command, value):
    args = ["--model", tiny_llama_dir, "--body-timeout-s", value]
    if command == "router":
        args += ["--decode", "http://127.0.0.1:9"]
    r = subprocess.run([sys.executable, "-m", "pdserve", command, *args],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0
    assert "body_timeout_s" in r.stderr or "--body-timeout-s" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

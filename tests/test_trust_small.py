"""The smaller holes at the host boundary, each shown refused (real processes and sockets):

* the prefill control socket drops a peer that sends a frame over `MAX_FRAME_BYTES`
  (nothing of it is queued), while other peers' frames pass;
* `--engine-address tcp://...` is refused (the engine channel has no authentication);
* a node listening beyond loopback without a cluster secret says so loudly;
* a native-kernel library at the cache's predictable path is loaded only when it is this
  user's and no one else can write it (or its folder).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq

from pdserve.kernels import native
from pdserve.kv_transfer.control_pump import MAX_FRAME_BYTES, ControlPump
from tests.servers import ROOT, free_port


def test_control_socket_drops_oversized_frames():
    ctx = zmq.Context()
    seen: list[int] = []
    pump = ControlPump(ctx, "tcp://127.0.0.1:0", lambda ident, raw, send: seen.append(len(raw)))
    big, small = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s in (big, small):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(pump.address)
        big.send(b"x" * (MAX_FRAME_BYTES + 1))
        small.send(b"hello")
        deadline = time.monotonic() + 10
        while 5 not in seen:
            assert time.monotonic() < deadline, seen
            time.sleep(0.01)
        time.sleep(0.2)
        assert seen == [5]  # the oversized frame never reached the screen or the queue
    finally:
        big.close(0)
        small.close(0)
        pump.close()
        ctx.term()


def _pdserve(*args: str, timeout_s: float = 60) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_CLUSTER")}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


def _stderr_until(proc: subprocess.Popen, needle: str, timeout_s: float = 60) -> str:
    """Read `proc`'s stderr until `needle` shows up (then kill it) or it exits."""
    seen, deadline = [], time.monotonic() + timeout_s
    os.set_blocking(proc.stderr.fileno(), False)
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if line:
                seen.append(line)
                if needle in line:
                    break
            elif proc.poll() is not None:
                seen.append(proc.stderr.read() or "")
                break
            else:
                time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    return "".join(seen)


def test_tcp_engine_address_refused_and_open_binds_warn(tiny_llama_dir):
    """Two nodes at once (each takes seconds to import): one asked for a tcp:// engine
    channel exits naming `engine_address`; one on 0.0.0.0 without a cluster secret logs a
    loud warning (a router there calls the same `warn_if_open`)."""
    tcp = _pdserve("serve", "--model", tiny_llama_dir, "--port", str(free_port()),
                   "--engine-address", f"tcp://127.0.0.1:{free_port()}")  # fmt: skip
    node = _pdserve("serve", "--model", tiny_llama_dir, "--host", "0.0.0.0",
                    "--port", str(free_port()))  # fmt: skip
    err = _stderr_until(tcp, "engine_address")
    assert tcp.returncode not in (0, None) and "engine_address" in err, err
    assert "only ipc://" in err
    err = _stderr_until(node, "WITHOUT a cluster secret")
    assert "this node listens on 0.0.0.0, beyond loopback, WITHOUT a cluster secret" in err


def test_native_cache_loads_only_this_users_private_files(tmp_path, monkeypatch):
    if native.find_compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    (tmp_path / "kernels").mkdir(mode=0o755)
    path = native.library_path("argmax", native.find_compiler())
    path.write_bytes(b"planted")  # what another user could leave at the predictable path
    path.chmod(0o666)
    with pytest.raises(RuntimeError, match="no one else can write"):
        native.build("argmax")
    path.chmod(0o600)
    assert native.build("argmax") == path  # this user's private file: taken as built
    path.chmod(0o600)
    os.chmod(path.parent, 0o777)
    with pytest.raises(RuntimeError, match="no one else can write"):
        native.build("argmax")
    os.chmod(path.parent, 0o755)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.so")
    (tmp_path / "elsewhere.so").write_bytes(b"x")
    with pytest.raises(RuntimeError, match="not a regular file"):
        native.build("argmax")


def test_redis_urls_are_shown_without_password_and_connect_with_it(monkeypatch):
    from pdserve.common.redis_auth import PASSWORD_ENV, redact, url_password, with_password

    assert redact("redis://:s3cret@h:1/0") == "redis://h:1/0"
    assert (
        redact("rediss://user:s3cret@h:1?ssl_ca_certs=/ca") == "rediss://user@h:1?ssl_ca_certs=/ca"
    )
    monkeypatch.setenv(PASSWORD_ENV, "p@ss word")
    url = with_password("rediss://h:1/0?ssl_ca_certs=/ca")
    assert url == "rediss://:p%40ss%20word@h:1/0?ssl_ca_certs=/ca"
    assert url_password(url) == "p@ss word" and redact(url) == "rediss://h:1/0?ssl_ca_certs=/ca"
    assert with_password("redis://:own@h:1") == "redis://:own@h:1"  # the URL's own wins
    assert with_password("unix:///tmp/r.sock") == "unix:///tmp/r.sock"

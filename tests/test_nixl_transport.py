"""NixlTransport against a real NIXL agent in a separate process (UCX over loopback).

The peer is this file run as a script (`python test_nixl_transport.py --peer ...`): it owns
a KV tensor filled with a sentinel and answers commands framed on stdin/stdout as
length-prefixed msgpack (no pickle crosses the pipe).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import struct
import subprocess
import sys
import time
import weakref

import msgspec
import pytest
import torch

pytest.importorskip("nixl")

from pdserve.kv_transfer.kv_layout import alloc_block_major  # noqa: E402
from pdserve.kv_transfer.nixl_transport import (  # noqa: E402
    REOPEN_FIRST_S,
    NixlTransport,
    PeerMetadata,
    TransferState,
)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SENTINEL = -7.0
# [num_layers, (2), num_blocks, block_size, num_kv_heads, head_dim]: 8 KiB per block-plane
SMALL = (4, 16, 16, 2, 64)


class Cmd(msgspec.Struct):
    op: str  # "add_peer" | "fill" | "dump" | "await_notif" | "exit"
    arg: bytes = b""
    timeout_s: float = 0.0


class NotifReply(msgspec.Struct):
    notifs: dict[str, list[bytes]]
    snapshot: bytes  # the peer's KV tensor, copied the moment the notif was seen


def _send(f, payload: bytes) -> None:
    f.write(struct.pack(">I", len(payload)) + payload)
    f.flush()


def _recv(f) -> bytes:
    header = f.read(4)
    if len(header) < 4:
        raise EOFError("peer closed the pipe")
    (n,) = struct.unpack(">I", header)
    return f.read(n)


def _kv(shape: tuple[int, ...], fill: float | None = None, block_major=False) -> torch.Tensor:
    layers, blocks, bs, heads, hd = shape
    kv = alloc_block_major(*shape) if block_major else torch.empty(layers, 2, blocks, bs, heads, hd)
    return kv.normal_() if fill is None else kv.fill_(fill)


class Peer:
    """A NIXL agent in a child process, driven through its stdin/stdout."""

    def __init__(self, name: str, shape: tuple[int, ...], block_major: bool = False) -> None:
        self.shape = shape
        cmd = [sys.executable, __file__, "--peer", name, "--shape", ",".join(map(str, shape))]
        self.proc = subprocess.Popen(
            cmd + (["--block-major"] if block_major else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")},
        )
        self.metadata = _recv(self.proc.stdout)

    def request(self, cmd: Cmd) -> bytes:
        _send(self.proc.stdin, msgspec.msgpack.encode(cmd))
        return _recv(self.proc.stdout)

    def kv(self, raw: bytes | None = None) -> torch.Tensor:
        raw = self.request(Cmd("dump")) if raw is None else raw
        layers, blocks, bs, heads, hd = self.shape
        flat = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        return flat.view(layers, 2, blocks, bs, heads, hd)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request(Cmd("exit"))
            except (EOFError, BrokenPipeError):
                pass
            self.proc.wait(timeout=10)


def _run_peer(name: str, shape: tuple[int, ...], block_major: bool) -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed (NIXL, UCX) goes to stderr, never into the frames
    inp = sys.stdin.buffer
    kv = _kv(shape, SENTINEL, block_major)
    transport = NixlTransport(name, kv)
    _send(out, transport.local_metadata())
    added = None
    while True:
        cmd = msgspec.msgpack.decode(_recv(inp), type=Cmd)
        if cmd.op == "add_peer":
            added = transport.add_peer(cmd.arg)
            _send(out, added.encode())
        elif cmd.op == "notify":  # a notification to the peer added last
            transport.send_notif(added, cmd.arg)
            _send(out, b"ok")
        elif cmd.op == "fill":
            kv.fill_(SENTINEL)
            _send(out, b"ok")
        elif cmd.op == "dump":
            _send(out, kv.numpy().tobytes())
        elif cmd.op == "await_notif":
            deadline = time.monotonic() + cmd.timeout_s
            notifs: dict[str, list[bytes]] = {}
            while not notifs and time.monotonic() < deadline:
                notifs = transport.get_notifs()
            snapshot = kv.clone()
            _send(out, msgspec.msgpack.encode(NotifReply(notifs, snapshot.numpy().tobytes())))
        elif cmd.op == "exit":
            transport.close()
            _send(out, b"bye")
            return


@pytest.fixture(scope="module")
def peer():
    # More blocks than the local side: dst ids are checked against the peer's count.
    p = Peer("peer-a", (SMALL[0], 24, *SMALL[2:]))
    yield p
    p.close()


@pytest.fixture(scope="module")
def local(peer):
    torch.manual_seed(0)
    t = NixlTransport("local-a", _kv(SMALL))
    name = t.add_peer(peer.metadata)
    assert name == "peer-a"
    yield t
    t.check_integrity()
    assert t.num_inflight == 0
    t.close()


def _write(local: NixlTransport, src, dst, **kw):
    h = local.write_blocks("peer-a", src, dst, **kw)
    assert local.wait(h, timeout_s=10) is TransferState.DONE
    local.release(h)
    return h


def test_scattered_blocks_land_bit_exact_and_others_untouched(local, peer):
    peer.request(Cmd("fill"))
    src, dst = [3, 0, 9, 10, 11, 5], [1, 23, 4, 5, 6, 12]
    h = _write(local, src, dst)
    # runs: 3->1, 0->23, 9..11->4..6, 5->12  => 4 runs x 2 layers x (K, V)
    assert h.stats.descriptors == 4 * SMALL[0] * 2
    assert h.stats.bytes == len(src) * SMALL[0] * 2 * local.layout.block_bytes
    assert h.stats.seconds is not None and h.stats.seconds > 0
    remote, mine = peer.kv(), local._kv_cache
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(remote[:, :, d].view(torch.int32), mine[:, :, s].view(torch.int32))
    untouched = [b for b in range(remote.shape[2]) if b not in dst]
    assert bool((remote[:, :, untouched] == SENTINEL).all())


def test_contiguous_run_is_one_descriptor_per_layer_kv(local, peer):
    peer.request(Cmd("fill"))
    h = _write(local, list(range(8)), list(range(10, 18)))
    assert h.stats.descriptors == SMALL[0] * 2
    remote = peer.kv()
    assert torch.equal(remote[:, :, 10:18], local._kv_cache[:, :, 0:8])

    peer.request(Cmd("fill"))
    h = _write(local, [4, 5, 6], [0, 1, 2], layers=range(1, 2))
    assert h.stats.descriptors == 2  # one layer, K and V
    remote = peer.kv()
    assert torch.equal(remote[1, :, 0:3], local._kv_cache[1, :, 4:7])
    assert bool((remote[0] == SENTINEL).all())


def test_notif_arrives_after_data_with_given_bytes(local, peer):
    peer.request(Cmd("fill"))
    h = local.write_blocks("peer-a", list(range(16)), list(range(8, 24)), notif=b"req-42:done")
    reply = msgspec.msgpack.decode(peer.request(Cmd("await_notif", timeout_s=10)), type=NotifReply)
    assert local.wait(h, timeout_s=10) is TransferState.DONE
    local.release(h)
    assert reply.notifs == {"local-a": [b"req-42:done"]}
    snap = peer.kv(reply.snapshot)  # what the peer saw the instant the notif arrived
    assert torch.equal(snap[:, :, 8:24], local._kv_cache[:, :, 0:16])

    local.send_notif("peer-a", b"standalone")
    reply = msgspec.msgpack.decode(peer.request(Cmd("await_notif", timeout_s=10)), type=NotifReply)
    assert reply.notifs == {"local-a": [b"standalone"]}


def test_bad_requests_raise_value_error(local, peer):
    bad = [
        (([0, 1], [0]), "src block ids but"),
        (([], []), "no blocks"),
        (([16], [0]), "src block ids out of range"),
        (([-1], [0]), "src block ids out of range"),
        (([0], [24]), "dst block ids out of range"),
        (([0, 1], [3, 3]), "duplicate dst"),
    ]
    for (src, dst), msg in bad:
        with pytest.raises(ValueError, match=msg):
            local.write_blocks("peer-a", src, dst)
    with pytest.raises(ValueError, match="outside"):
        local.write_blocks("peer-a", [0], [0], layers=range(SMALL[0] - 1, SMALL[0] + 1))
    with pytest.raises(ValueError, match="unknown peer"):
        local.write_blocks("nobody", [0], [0])
    md = msgspec.msgpack.decode(peer.metadata, type=PeerMetadata)
    other = msgspec.structs.replace(md, layout=msgspec.structs.replace(md.layout, head_dim=16))
    with pytest.raises(ValueError, match="head_dim"):
        local.add_peer(msgspec.msgpack.encode(other))
    assert local.add_peer(peer.metadata) == "peer-a"  # idempotent
    assert local.peers == ["peer-a"]
    local.check_integrity()
    assert local.num_inflight == 0


def test_block_major_caches_move_each_run_as_one_descriptor(local):
    """A block-major cache holds a block's every layer, K and V, in one range: a run of
    blocks (or one scattered block) is ONE descriptor, and the bytes land bit-exact."""
    bm_peer = Peer("peer-bm", (SMALL[0], 24, *SMALL[2:]), block_major=True)
    try:
        with pytest.raises(ValueError, match="block_major"):  # layouts must be of one kind
            local.add_peer(bm_peer.metadata)
        with NixlTransport("local-bm", _kv(SMALL, block_major=True)) as t:
            assert t.layout.block_major and t.layout.stride_bytes == 2 * SMALL[0] * 8192
            name = t.add_peer(bm_peer.metadata)
            src, dst = [3, 0, 9, 10, 11, 5], [1, 23, 4, 5, 6, 12]
            h = t.write_blocks(name, src, dst)
            assert t.wait(h, timeout_s=10) is TransferState.DONE
            t.release(h)
            assert h.stats.descriptors == 4  # runs 3->1, 0->23, 9..11->4..6, 5->12
            assert h.stats.bytes == len(src) * SMALL[0] * 2 * t.layout.block_bytes
            remote, mine = bm_peer.kv(), t._kv_cache
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(
                    remote[:, :, d].view(torch.int32), mine[:, :, s].view(torch.int32)
                )
            untouched = [b for b in range(remote.shape[2]) if b not in dst]
            assert bool((remote[:, :, untouched] == SENTINEL).all())

            bm_peer.request(Cmd("fill"))
            h = t.write_blocks(name, [4, 5, 6], [0, 1, 2], layers=range(1, 2))
            assert t.wait(h, timeout_s=10) is TransferState.DONE
            t.release(h)
            assert h.stats.descriptors == 3  # one layer: one range per block
            remote = bm_peer.kv()
            assert torch.equal(remote[1, :, 0:3], mine[1, :, 4:7])
            assert bool((remote[0] == SENTINEL).all()) and bool(
                (remote[1, :, 3:] == SENTINEL).all()
            )
            t.check_integrity()
    finally:
        bm_peer.close()
    with pytest.raises(ValueError, match="contiguous"):
        NixlTransport("local-strided", _kv(SMALL)[:, :, ::2])


def test_notifs_that_arrive_while_a_peer_connects_are_kept(peer):
    """`add_peer` progresses the new connection (so the first WRITE need not set it up);
    a notification received meanwhile is returned by the next `get_notifs`, not lost."""
    with NixlTransport("local-connect", _kv(SMALL), progress_thread=False) as t:
        assert peer.request(Cmd("add_peer", t.local_metadata())) == b"local-connect"
        assert peer.request(Cmd("notify", b"sent before we knew peer-a")) == b"ok"
        assert t.add_peer(peer.metadata, connect_s=2.0) == "peer-a"  # progresses for 2 s
        assert t.get_notifs() == {"peer-a": [b"sent before we knew peer-a"]}
        assert t.get_notifs() == {}
        _write(t, [0, 1], [2, 3])  # the connection it made carries WRITEs


def test_dropped_handle_is_reported_as_leak(peer):
    with NixlTransport("local-leak", _kv(SMALL)) as t:
        t.add_peer(peer.metadata)
        h = t.write_blocks("peer-a", [0], [0])
        t.wait(h, timeout_s=10)
        t.check_integrity()
        del h
        gc.collect()
        with pytest.raises(RuntimeError, match="without release"):
            t.check_integrity()


def _write_and_await(t: NixlTransport, peer, src, dst, notif: bytes):
    """A WRITE to a freshly filled peer that must end DONE (polled here: no progress
    thread), then the notifications the peer got and its KV as it was at their arrival."""
    peer.request(Cmd("fill"))
    h = t.write_blocks("peer-a", src, dst, notif=notif)
    assert t.wait(h, timeout_s=10) is TransferState.DONE
    t.release(h)
    reply = msgspec.msgpack.decode(peer.request(Cmd("await_notif", timeout_s=10)), type=NotifReply)
    return reply.notifs, peer.kv(reply.snapshot)


def test_stop_writes_rebuilds_the_agent_and_its_peers_stay_usable(peer):
    """`stop_writes` ends every WRITE in flight by destroying the agent's UCX worker and
    builds it again under the same name (tests/multihost/test_cancel.py shows what it
    stops on a slow link): the handle ends, the peer is still known, and the next WRITE
    lands intact with its notification, sent as the same agent."""
    with NixlTransport("local-stop", _kv(SMALL), progress_thread=False) as t:
        t.add_peer(peer.metadata)
        peer.request(Cmd("fill"))
        h = t.write_blocks("peer-a", list(range(16)), list(range(8, 24)))
        was_pending = h.state is TransferState.PENDING
        assert t.stop_writes() == int(was_pending)
        assert t.agent_restarts == 1 and t.peers == ["peer-a"]
        assert t.poll(h) in (TransferState.DONE, TransferState.FAILED)
        if was_pending:
            assert h.state is TransferState.FAILED
        t.release(h)
        notifs, snap = _write_and_await(t, peer, [3, 4, 5], [20, 21, 22], b"after the stop")
        assert notifs == {"local-stop": [b"after the stop"]}
        assert torch.equal(snap[:, :, 20:23], t._kv_cache[:, :, 3:6])
        assert bool((snap[:, :, :20] == SENTINEL).all())
        t.check_integrity()
        assert t.num_inflight == 0


def test_a_rebuild_ucx_refuses_leaves_the_transport_down_then_it_comes_back(peer, monkeypatch):
    """Multihost drill 2 cut the prefill host's link (device down) with WRITEs in flight:
    the rebuild in `stop_writes` found no usable device and its error killed the engine.
    Here UCX really refuses (its device list names no device) and the transport stays
    down: a WRITE fails at once, a peer introduced meanwhile is kept; once UCX can start,
    the next try after the backoff rebuilds it and a WRITE lands intact."""
    with NixlTransport("local-down", _kv(SMALL), progress_thread=False) as t:
        t.add_peer(peer.metadata)
        monkeypatch.setenv("UCX_NET_DEVICES", "pdserve-no-such-device")
        h = t.write_blocks("peer-a", list(range(16)), list(range(8, 24)))
        was_pending = h.state is TransferState.PENDING
        old_agent = weakref.ref(t._agent)
        assert t.stop_writes() == int(was_pending)  # raises nothing
        gc.collect()
        assert old_agent() is None  # destroyed, though no new one replaced it: WRITEs stop
        assert t.is_down and t.agent_restarts == 1 and t.peers == ["peer-a"]
        assert h.state is not TransferState.PENDING
        t.release(h)
        h = t.write_blocks("peer-a", [0], [1])
        assert h.state is TransferState.FAILED  # at once, not at a deadline
        t.release(h)
        assert t.get_notifs() == {} and t.progress_warmups() == []
        with pytest.raises(RuntimeError, match="down"):
            t.send_notif("peer-a", b"x")
        assert t.stop_writes() == 0 and t.agent_restarts == 1  # nothing to stop
        monkeypatch.delenv("UCX_NET_DEVICES")  # the link is back
        t.progress_warmups()  # not yet due: still down
        assert t.is_down
        time.sleep(REOPEN_FIRST_S)
        deadline = time.monotonic() + 10
        while t.num_warming or t.is_down:  # the due try rebuilds it and warms the peer up
            assert time.monotonic() < deadline
            assert all(problem is None for _, problem in t.progress_warmups())
            time.sleep(0.01)
        notifs, snap = _write_and_await(t, peer, [3, 4], [20, 21], b"back")
        assert notifs == {"local-down": [b"back"]}
        assert torch.equal(snap[:, :, 20:22], t._kv_cache[:, :, 3:5])
        t.check_integrity()
        assert t.num_inflight == 0


def test_write_to_killed_peer_fails_within_bounded_time():
    victim = Peer("peer-victim", SMALL)
    with NixlTransport("local-b", _kv(SMALL)) as t:
        name = t.add_peer(victim.metadata)
        h = t.write_blocks(name, [0, 1], [2, 3])
        assert t.wait(h, timeout_s=10) is TransferState.DONE
        t.release(h)
        victim.proc.kill()
        victim.proc.wait(timeout=10)

        t0 = time.monotonic()
        state = TransferState.PENDING
        while state is not TransferState.FAILED and time.monotonic() - t0 < 20:
            h = t.write_blocks(name, list(range(16)), list(range(16)), notif=b"x")
            state = t.wait(h, timeout_s=5)
            t.release(h)  # a DONE here means the kernel had not yet torn the socket down
        assert state is TransferState.FAILED
        assert time.monotonic() - t0 < 20
        t.remove_peer(name)
        t.check_integrity()
        assert t.num_inflight == 0
        assert t.stats.failed >= 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer", required=True)
    parser.add_argument("--shape", required=True)
    parser.add_argument("--block-major", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _run_peer(args.peer, tuple(int(x) for x in args.shape.split(",")), args.block_major)

"""The control channel of `pdserve bench kv`: length-prefixed msgpack frames over TCP.

Only addresses are shared between the two sides; everything else crosses this socket:

  peer -> listener  `KVHello`      the benchmark geometry (the listener allocates to it)
  listener -> peer  `KVReady`      NIXL metadata of its paged KV tensors and flat region
                    `KVRefused`    the geometry is out of bounds (reason)
  peer -> listener  `KVChecksum`   hash these destination blocks of one cache (all layers, K, V)
  listener -> peer  `KVDigest`     sha256 of those bytes: the peer compares with its source
  peer -> listener  `KVBye`        done; the listener closes its agents

Decoding is typed (msgspec): a malformed frame raises, nothing is unpickled.
"""

from __future__ import annotations

import socket
import struct

import msgspec

MAX_FRAME = 64 * 2**20


class KVGeometry(msgspec.Struct, frozen=True, kw_only=True):
    dtype: str  # fp32 | bf16
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    max_blocks: int  # per (layer, kv) plane
    flat_layers: int  # flat region = flat_layers x 2 planes x flat_granule bytes
    flat_granule: int
    error_mode: str  # UCX error handling: peer | none
    progress_thread: bool


class KVHello(msgspec.Struct, tag=True, kw_only=True):
    geometry: KVGeometry


class KVReady(msgspec.Struct, tag=True, kw_only=True):
    kv_metadata: bytes
    flat_metadata: bytes
    bm_metadata: bytes  # the block-major paged cache
    setup_ms: float = 0.0  # KVHello -> KVReady on the listener: allocate and register KV


class KVRefused(msgspec.Struct, tag=True, kw_only=True):
    reason: str


class KVChecksum(msgspec.Struct, tag=True, kw_only=True):
    block_ids: list[int]
    cache: str = "kv"  # "kv" (layer-major) or "bm" (block-major)


class KVDigest(msgspec.Struct, tag=True, kw_only=True):
    sha256: str


class KVBye(msgspec.Struct, tag=True):
    pass


Frame = KVHello | KVReady | KVRefused | KVChecksum | KVDigest | KVBye
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Frame)


def send(sock: socket.socket, msg: Frame) -> None:
    data = _enc.encode(msg)
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv(sock: socket.socket) -> Frame:
    """One frame; ConnectionError if the other side closed, ValueError if malformed."""
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ValueError(f"control frame of {n} bytes exceeds {MAX_FRAME}")
    try:
        return _dec.decode(_recv_exact(sock, n))
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed control frame: {e}") from e


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the other side closed the control connection")
        buf += chunk
    return bytes(buf)


def parse_addr(addr: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 as `[::1]:PORT`) -> (host, port); ValueError naming the input."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"address {addr!r} must look like HOST:PORT")
    return host.strip("[]"), int(port)

"""`pdserve bench kv`: NIXL KV-block WRITEs between two processes, or two hosts.

    pdserve bench kv --out results/kv_transfer.json              # both sides on this host
    pdserve bench kv --listen 0.0.0.0:7300                      # host B: the target
    pdserve bench kv --peer hostB:7300 --out results/kv.json    # host A: the initiator

The two sides share nothing but the address: the initiator (`--peer`, or this process in
local mode, which starts a `--listen` child on a free loopback port) sends the geometry
over a TCP control channel (`pdserve.bench.kv_wire`), the listener allocates its KV tensor and
answers with its NIXL metadata, and the initiator WRITEs into it. Afterwards the listener
hashes the written blocks (a scattered WRITE into each of its two paged caches, layer-major
and block-major) and the initiator checks them against its source bytes. UCX is
configured by each side's environment (UCX_TLS, UCX_NET_DEVICES, ...). Prints a table and
writes JSON and a PNG plot (`--out`).

Before the table's cases the initiator meets the listener as a new peer and reports what
that costs (`connection_setup` in the JSON, a line under the table): from first contact
(the control connection up) to the first completed 1-block WRITE (metadata round trip,
`add_peer` with its UCX connection, the first WRITE), against a warm WRITE of the same
block. The listener's own KV allocation and registration is reported beside it, not in
it (a node does that at start).

The same table carries the LMCache path (`--lmcache`, on when lmcache is installed): for
the sizes up to `--lmcache-max-tokens`, this process stores a prompt's blocks from a paged
cache into LMCache and waits until Redis holds every chunk (`lmcache_store_visible`: what
a node on another host needs before it can read), then a second LMCache store with an
empty local tier retrieves them into scattered blocks (`lmcache_retrieve`), with redis-py
SET / GET of the same bytes, one value per chunk, pipelined, as the yardstick (`x redis`:
LMCache's p50 time over redis-py's; goal <= 1.5). Both KV cache layouts
(`--lmcache-layouts`): `lmcache_*` rows from a layer-major cache, `lmcache_bm_*` from a
block-major one (each block holds every layer's K and V), measured side by side. Redis:
`--lmcache-url`, or a local redis-server started for the run (bench/kv_store.py
measures; `bench kv-store` is the same with more detail).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

from pdserve.bench.kv_wire import (
    KVBye,
    KVChecksum,
    KVDigest,
    KVGeometry,
    KVHello,
    KVReady,
    KVRefused,
    parse_addr,
    recv,
    send,
)

logger = logging.getLogger(__name__)

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; engine block size 16.
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
DEFAULT_TOKENS = (16, 64, 256, 1024, 4096, 16384)


def add_arguments(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--listen", metavar="HOST:PORT", help="be the target, bound here")
    mode.add_argument("--peer", metavar="HOST:PORT", help="be the initiator against a listener")
    p.add_argument("--out", type=Path, default=Path("results/kv_transfer.json"))
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    p.add_argument("--iters", type=int, default=50, help="iterations at <= 16 MiB")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--error-mode", choices=("peer", "none"), default="peer")
    p.add_argument("--progress-thread", choices=("on", "off"), default="off",
                   help="NIXL progress thread (busy-polls a core per agent)")  # fmt: skip
    p.add_argument("--max-bytes", type=int, default=8 * 2**30,
                   help="listener: refuse geometries needing more memory than this")  # fmt: skip
    p.add_argument("--connect-timeout", type=float, default=60.0,
                   help="initiator: keep trying to reach the listener this long")  # fmt: skip
    p.add_argument("--listen-timeout", type=float, default=600.0,
                   help="listener: give up if no initiator connects within this")  # fmt: skip
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--lmcache",
        choices=("auto", "on", "off"),
        default="auto",
        help="add the LMCache path's rows (auto: when lmcache is installed)",
    )
    p.add_argument(
        "--lmcache-url",
        default=None,
        help="redis:// URL the LMCache rows go through (default: a local one)",
    )
    p.add_argument("--lmcache-max-tokens", type=int, default=4096)
    p.add_argument("--lmcache-iters", type=int, default=5)
    p.add_argument("--lmcache-chunk", type=int, default=256, help="LMCache chunk (tokens)")  # fmt: skip
    p.add_argument("--lmcache-layouts", nargs="+", choices=("layer_major", "block_major"),
                   default=["layer_major", "block_major"],
                   help="KV cache layouts of the LMCache rows (lmcache_*, lmcache_bm_*)")  # fmt: skip


# -- listener (target) --------------------------------------------------------------------
def listen(addr: str, max_bytes: int, timeout_s: float) -> None:
    """Serve one initiator session on `addr`, then return.

    SystemExit if no initiator connects within `timeout_s`, or the connection breaks.
    """
    from pdserve.bench import kv_cases  # noqa: F401  torch + nixl loaded before any peer comes

    host, port = parse_addr(addr)
    with socket.create_server((host, port)) as srv:
        logger.info("bench kv: listening on %s:%d", *srv.getsockname()[:2])
        srv.settimeout(timeout_s)
        try:
            conn, peer_addr = srv.accept()
        except TimeoutError:
            raise SystemExit(f"pdserve bench kv: no initiator within {timeout_s:g} s") from None
    conn.settimeout(None)
    try:
        _serve_session(conn, peer_addr, max_bytes)
    except (ConnectionError, ValueError) as e:
        raise SystemExit(f"pdserve bench kv: session with {peer_addr} broke: {e}") from None


def _serve_session(conn: socket.socket, peer_addr, max_bytes: int) -> None:
    from pdserve.bench import kv_cases

    with conn:
        hello = recv(conn)
        if not isinstance(hello, KVHello):
            send(conn, KVRefused(reason=f"expected KVHello, got {type(hello).__name__}"))
            return
        g = hello.geometry
        problem = _check_geometry(g, max_bytes, kv_cases)
        if problem:
            logger.warning("bench kv: refused %s: %s", peer_addr, problem)
            send(conn, KVRefused(reason=problem))
            return
        t0 = time.perf_counter()
        side = kv_cases.transports(g, f"bench-listener-{os.getpid()}", fill=False)
        try:
            ready = KVReady(kv_metadata=side.kv.local_metadata(),
                            flat_metadata=side.flat.local_metadata(),
                            bm_metadata=side.bm.local_metadata(),
                            setup_ms=(time.perf_counter() - t0) * 1e3)  # fmt: skip
            send(conn, ready)
            while True:
                # Like an engine loop: progress NIXL every millisecond, answer the peer.
                if not select.select([conn], [], [], 1e-3)[0]:
                    for t in (side.kv, side.flat, side.bm):
                        t.get_notifs()
                    continue
                msg = recv(conn)
                if isinstance(msg, KVChecksum):
                    ids = [b for b in msg.block_ids if 0 <= b < g.max_blocks]
                    tensor = side.bm_tensor if msg.cache == "bm" else side.kv_tensor
                    send(conn, KVDigest(sha256=kv_cases.blocks_digest(tensor, ids)))
                elif isinstance(msg, KVBye):
                    break
        finally:
            side.close()


def _check_geometry(g: KVGeometry, max_bytes: int, kv_cases) -> str | None:
    if g.dtype not in kv_cases.DTYPES:
        return f"dtype {g.dtype!r} is not one of {sorted(kv_cases.DTYPES)}"
    if g.error_mode not in ("peer", "none"):
        return f"error_mode {g.error_mode!r} must be peer or none"
    dims = (g.layers, g.kv_heads, g.head_dim, g.block_size, g.max_blocks, g.flat_layers,
            g.flat_granule)  # fmt: skip
    if min(dims) < 1:
        return "every dimension must be >= 1"
    need = kv_cases.geometry_bytes(g)
    if need > max_bytes:
        return f"the geometry needs {need} bytes, over this listener's --max-bytes {max_bytes}"
    return None


# -- initiator ----------------------------------------------------------------------------
def _connect(addr: str, timeout_s: float) -> socket.socket:
    host, port = parse_addr(addr)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=10)
        except OSError as e:
            if time.monotonic() > deadline:
                raise SystemExit(f"pdserve bench kv: cannot reach {addr}: {e}") from None
            time.sleep(0.2)


def initiate(args: argparse.Namespace, addr: str) -> dict:
    from pdserve.bench import kv_cases

    item = kv_cases.DTYPES[args.dtype].itemsize
    block_bytes = BLOCK * KV_HEADS * HEAD_DIM * item
    max_req_blocks = -(-max(args.tokens) // BLOCK)
    g = KVGeometry(dtype=args.dtype, layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                   block_size=BLOCK, max_blocks=2 * max_req_blocks, flat_layers=max_req_blocks,
                   flat_granule=LAYERS * block_bytes, error_mode=args.error_mode,
                   progress_thread=args.progress_thread == "on")  # fmt: skip
    # Our agents and KV exist before we meet the peer, as a node's do.
    side = kv_cases.transports(g, f"bench-initiator-{os.getpid()}", fill=True)
    try:
        conn = _connect(addr, args.connect_timeout)
    except SystemExit:
        side.close()
        raise
    t_contact = time.perf_counter()  # first contact: the control connection is up
    conn.settimeout(None)
    with conn:
        try:
            send(conn, KVHello(geometry=g))
            ready = recv(conn)
            if isinstance(ready, KVRefused):
                raise SystemExit(f"pdserve bench kv: the listener refused: {ready.reason}")
            assert isinstance(ready, KVReady)
            hello_ms = (time.perf_counter() - t_contact) * 1e3
            kv_peer, setup = kv_cases.first_write(side.kv, ready.kv_metadata)
            setup = connection_setup(hello_ms, ready.setup_ms, setup)
            logger.info("bench kv: connection setup %s", json.dumps(setup))
            peers = (kv_peer, side.flat.add_peer(ready.flat_metadata),
                     side.bm.add_peer(ready.bm_metadata))  # fmt: skip
            rows = kv_cases.measure(g, side, peers, args.tokens, args.iters, args.warmup,
                                    on_row=lambda r: logger.info("%s", json.dumps(r)),
                                    progress=not args.no_progress)  # fmt: skip
            # Last, each cache's scattered WRITE once more; the listener hashes what landed.
            ids = list(range(max_req_blocks))
            for cache, t, peer, tensor in (("kv", side.kv, peers[0], side.kv_tensor),
                                           ("bm", side.bm, peers[2], side.bm_tensor)):  # fmt: skip
                digest = kv_cases.final_write(t, peer, tensor, max_req_blocks, step=2)
                send(conn, KVChecksum(block_ids=ids, cache=cache))
                remote = recv(conn)
                if not isinstance(remote, KVDigest) or remote.sha256 != digest:
                    raise SystemExit(f"pdserve bench kv: the listener's {cache} blocks differ "
                                     "from the bytes written")  # fmt: skip
                t.check_integrity()
            send(conn, KVBye())
        finally:
            side.close()
    return {"config": _env_config(g, addr), "bytes_verified": True, "results": rows,
            "connection_setup": setup}  # fmt: skip


def connection_setup(hello_ms: float, listener_setup_ms: float, first: dict) -> dict:
    """What meeting a new peer costs, from first contact (the control connection up) to
    the first completed WRITE: the hello round trip (less the listener's own allocation
    and registration of its KV, which a real node did at start), `add_peer` (load the
    metadata, make the UCX connection, post the warm-up), the warm-up's wait (progressed
    as an idle loop does), the first WRITE; against a warm WRITE of the same block.
    `setup_ms` = all of it less a warm WRITE: the connection's own cost."""
    exchange = max(hello_ms - listener_setup_ms, 0.0)
    total = exchange + first["add_peer_ms"] + first["warmup_ms"] + first["first_write_ms"]
    return {
        "contact_to_first_write_ms": round(total, 4),
        "metadata_exchange_ms": round(exchange, 4),
        "listener_setup_ms": round(listener_setup_ms, 4),  # reported, not in the total
        **first,
        "setup_ms": round(total - first["warm_write_ms"], 4),
        "first_vs_warm": round(first["first_write_ms"] / first["warm_write_ms"], 3),
    }


def _env_config(g: KVGeometry, addr: str) -> dict:
    import torch

    return {
        "model": "SmolLM2-135M",
        "peer": addr,
        "layers": g.layers,
        "kv_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "block_size": g.block_size,
        "dtype": g.dtype,
        "ucx_error_handling_mode": g.error_mode,
        "progress_thread": g.progress_thread,
        "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def _local(args: argparse.Namespace) -> dict:
    """Both sides on this host: a `--listen` child on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pdserve", "bench", "kv", "--listen", addr,
           "--max-bytes", str(args.max_bytes), "--log-level", "warning"]  # fmt: skip
    child = subprocess.Popen(cmd)
    try:
        return initiate(args, addr)
    finally:
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _lmcache_rows(args: argparse.Namespace, report: dict) -> None:
    """Append the LMCache path's rows to `report` (bench/kv_store.py measures them)."""
    if args.lmcache == "off":
        return
    try:
        from pdserve.bench.kv_store import kv_table_rows
    except ImportError as e:
        if args.lmcache == "on":
            raise SystemExit(f"pdserve bench kv: --lmcache on needs lmcache: {e}") from None
        logger.info("bench kv: no LMCache rows (%s)", e)
        return
    sizes = sorted({t for t in args.tokens if t <= args.lmcache_max_tokens})
    if not sizes:
        return
    flat = {r["tokens"]: r["gbps"] for r in report["results"] if r["method"] == "nixl_flat"}
    rows = kv_table_rows(sizes, args.lmcache_iters, args.lmcache_chunk, args.lmcache_url, flat,
                         args.lmcache_layouts)  # fmt: skip
    report["results"] += rows
    report["lmcache"] = {"redis": args.lmcache_url or "local redis-server",
                         "chunk_size": args.lmcache_chunk, "iters": args.lmcache_iters,
                         "layouts": args.lmcache_layouts, "bytes_verified": True}  # fmt: skip


def _ratio(x: float | None) -> str:
    return f"{x:>8.3f}" if x is not None else f"{'-':>8}"


def format_table(report: dict) -> str:
    lines = [f"{'tokens':>7} {'method':<24} {'MiB':>8} {'descs':>6} {'p50 ms':>9} "
             f"{'p99 ms':>9} {'GB/s':>7} {'vs flat':>8} {'x redis':>8}"]  # fmt: skip
    for r in sorted(report["results"], key=lambda r: r["tokens"]):
        lines.append(f"{r['tokens']:>7} {r['method']:<24} {r['bytes'] / 2**20:>8.2f} "
                     f"{r['descriptors']:>6} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} "
                     f"{r['gbps']:>7.2f} {_ratio(r['vs_nixl_flat'])} "
                     f"{_ratio(r.get('x_redis_py'))}")  # fmt: skip
    return "\n".join(lines)


def format_setup(report: dict) -> str:
    s = report.get("connection_setup")
    if not s:
        return ""
    return (f"\nnew peer: first contact -> first WRITE done {s['contact_to_first_write_ms']:.2f} ms "
            f"(metadata {s['metadata_exchange_ms']:.2f} + add_peer {s['add_peer_ms']:.2f} + "
            f"warm-up {s['warmup_ms']:.2f} + first WRITE {s['first_write_ms']:.3f}); warm WRITE {s['warm_write_ms']:.3f} ms "
            f"({s['write_bytes'] / 2**10:.0f} KiB); setup cost {s['setup_ms']:.2f} ms, first "
            f"WRITE {s['first_vs_warm']:.1f}x a warm one; listener KV setup "
            f"{s['listener_setup_ms']:.1f} ms (not counted)")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    try:
        if args.listen:
            listen(args.listen, args.max_bytes, args.listen_timeout)
            return
        report = initiate(args, args.peer) if args.peer else _local(args)
        _lmcache_rows(args, report)
    except ValueError as e:
        raise SystemExit(f"pdserve bench kv: {e}") from None
    print(format_table(report) + format_setup(report), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    from pdserve.bench.plots import plot_kv

    png = plot_kv(report, args.out.with_suffix(".png"))
    logger.info("wrote %s and %s", args.out, png)

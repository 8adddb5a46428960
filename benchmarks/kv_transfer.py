"""KV transfer benchmark: paged-block NIXL WRITEs between two processes vs the limits.

    python benchmarks/kv_transfer.py --out results/kv_transfer.json [--dtype bf16]

For each request size (tokens) the initiator moves the request's KV blocks, in the default
model's shapes (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, block 16), into a target
process with `NixlTransport.write_blocks`, once with contiguous block ids (2 descriptors
per layer) and once with scattered ids (every other source block: one descriptor per
block per layer-kv). Beside them: (a) memcpy, a torch `copy_` of the same byte count in
one process, and (b) one contiguous NIXL WRITE of the same byte count (a flat region).
Latency is post-to-DONE wall time; GB/s is bytes / p50 latency. UCX is configured by
the environment (UCX_TLS, UCX_RNDV_THRESH, ...), inherited by the target process;
`--error-mode none` lets UCX pick shared-memory transports but drops peer-failure
detection (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kv_transfer.nixl_transport import NixlTransport, TransferState  # noqa: E402

logger = logging.getLogger("benchmarks.kv_transfer")

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; engine block size 16.
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_TOKENS = (16, 64, 256, 1024, 4096, 16384)


class Config(msgspec.Struct, frozen=True):
    dtype: str
    max_blocks: int  # per (layer, kv) plane; 2x the largest request for scattered ids
    flat_layers: int  # flat region = flat_layers x 2 planes x flat_granule bytes
    flat_granule: int
    error_mode: str
    progress_thread: bool


def _send(f, payload: bytes) -> None:
    f.write(struct.pack(">I", len(payload)) + payload)
    f.flush()


def _recv(f) -> bytes:
    (n,) = struct.unpack(">I", f.read(4))
    return f.read(n)


def _transports(cfg: Config, role: str) -> tuple[NixlTransport, NixlTransport]:
    """The paged KV cache and a flat byte region of one side.

    The flat region is shaped so that block 0 of layers [0, n) is the region's first
    n * 2 * granule bytes: those 2n planes are adjacent on both sides, so the transport
    coalesces them into ONE descriptor, the contiguous-WRITE baseline.
    """
    dtype = DTYPES[cfg.dtype]
    kv = torch.zeros(LAYERS, 2, cfg.max_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    if role == "initiator":
        kv.uniform_()
    flat = torch.zeros(cfg.flat_layers, 2, 1, cfg.flat_granule, 1, 1, dtype=torch.uint8)
    kw = {
        "backend_params": {"ucx_error_handling_mode": cfg.error_mode},
        "progress_thread": cfg.progress_thread,
    }
    return (
        NixlTransport(f"bench-{role}-kv", kv, **kw),
        NixlTransport(f"bench-{role}-flat", flat, **kw),
    )


def run_target(cfg: Config) -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # keep library chatter off the frame pipe
    kv, flat = _transports(cfg, "target")
    _send(out, msgspec.msgpack.encode([kv.local_metadata(), flat.local_metadata()]))
    # Like an engine loop: progress NIXL (get_notifs) every millisecond until told to stop.
    while not select.select([sys.stdin], [], [], 1e-3)[0]:
        kv.get_notifs()
        flat.get_notifs()
    kv.close()
    flat.close()


def _time_write(
    t: NixlTransport, peer: str, src: list[int], dst: list[int], layers: range | None = None
) -> tuple[float, int]:
    t0 = time.perf_counter()
    h = t.write_blocks(peer, src, dst, layers=layers)
    state = t.wait(h, timeout_s=120)
    elapsed = time.perf_counter() - t0
    t.release(h)
    if state is not TransferState.DONE:
        raise RuntimeError(f"transfer to {peer} ended {state.name}")
    return elapsed, h.stats.descriptors


def _summary(tokens: int, method: str, nbytes: int, descs: int, times: list[float]) -> dict:
    p50, p99 = np.percentile(times, 50), np.percentile(times, 99)
    return {
        "tokens": tokens,
        "method": method,
        "bytes": nbytes,
        "descriptors": descs,
        "iters": len(times),
        "p50_ms": round(p50 * 1e3, 4),
        "p99_ms": round(p99 * 1e3, 4),
        "gbps": round(nbytes / p50 / 1e9, 3),
    }


def run_initiator(args: argparse.Namespace) -> dict:
    itemsize = DTYPES[args.dtype].itemsize
    block_bytes = BLOCK * KV_HEADS * HEAD_DIM * itemsize
    max_req_blocks = -(-max(args.tokens) // BLOCK)
    # flat: one "layer" per request block, each plane LAYERS blocks' worth of bytes
    cfg = Config(args.dtype, 2 * max_req_blocks, max_req_blocks, LAYERS * block_bytes,
                 args.error_mode, args.progress_thread == "on")  # fmt: skip
    target = subprocess.Popen(
        [sys.executable, __file__, "--role", "target", "--config", msgspec.json.encode(cfg)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    kv, flat = _transports(cfg, "initiator")
    kv_md, flat_md = msgspec.msgpack.decode(_recv(target.stdout), type=list[bytes])
    kv_peer, flat_peer = kv.add_peer(kv_md), flat.add_peer(flat_md)
    torch.set_num_threads(1)  # memcpy baseline: one copying thread, like one CMA put
    results = []
    src_mem = torch.empty(flat.layout.total_bytes, dtype=torch.uint8).random_()
    dst_mem = torch.empty_like(src_mem)

    def memcpy(nb: int, nbytes: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        dst_mem[:nbytes].copy_(src_mem[:nbytes])
        return time.perf_counter() - t0, 1

    cases = {
        "memcpy": memcpy,
        "nixl_flat": lambda nb, _: _time_write(flat, flat_peer, [0], [0], layers=range(nb)),
        "paged_contig": lambda nb, _: _time_write(kv, kv_peer, list(range(nb)), list(range(nb))),
        "paged_scattered": lambda nb, _: _time_write(
            kv, kv_peer, list(range(0, 2 * nb, 2)), list(range(nb))
        ),
    }
    plan = []
    for tokens in args.tokens:
        nbytes = -(-tokens // BLOCK) * LAYERS * 2 * block_bytes
        plan.append((tokens, max(5, min(args.iters, int(args.iters * 2**24 / nbytes)))))
    bar = tqdm(total=sum(args.warmup + n for _, n in plan), desc="kv transfer", unit="round")
    for tokens, iters in plan:
        nb = -(-tokens // BLOCK)
        nbytes = nb * LAYERS * 2 * block_bytes
        times: dict[str, list[float]] = {m: [] for m in cases}
        descs: dict[str, int] = {}
        # Round-robin over the methods so that noise from other load hits all of them alike.
        for i in range(args.warmup + iters):
            for method, fn in cases.items():
                dt, descs[method] = fn(nb, nbytes)
                if i >= args.warmup:
                    times[method].append(dt)
            bar.update()
        for method in cases:
            row = _summary(tokens, method, nbytes, descs[method], times[method])
            results.append(row)
            print(json.dumps(row), flush=True)
    bar.close()
    _send(target.stdin, b"exit")
    target.wait(timeout=60)
    kv.check_integrity()
    kv.close()
    flat.close()
    return {"config": _env_config(cfg), "results": _with_ratios(results)}


def _with_ratios(rows: list[dict]) -> list[dict]:
    """Add each row's bandwidth as a fraction of the contiguous NIXL WRITE of that size."""
    flat = {r["tokens"]: r["gbps"] for r in rows if r["method"] == "nixl_flat"}
    for r in rows:
        r["vs_nixl_flat"] = round(r["gbps"] / flat[r["tokens"]], 3) if r["tokens"] in flat else None
    return rows


def _env_config(cfg: Config) -> dict:
    ucx = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
    return {
        "model": "SmolLM2-135M",
        "layers": LAYERS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "block_size": BLOCK,
        "dtype": cfg.dtype,
        "ucx_error_handling_mode": cfg.error_mode,
        "progress_thread": cfg.progress_thread,
        "ucx_env": ucx,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in ("memcpy", "nixl_flat", "paged_contig", "paged_scattered"):
        rows = [r for r in report["results"] if r["method"] == method]
        mib = [r["bytes"] / 2**20 for r in rows]
        ax_bw.plot(mib, [r["gbps"] for r in rows], marker="o", label=method)
        ax_lat.plot(mib, [r["p50_ms"] for r in rows], marker="o", label=f"{method} p50")
    for ax in (ax_bw, ax_lat):
        ax.set_xscale("log")
        ax.set_xlabel("request KV bytes (MiB)")
        ax.grid(True, which="both", alpha=0.3)
    ax_lat.set_yscale("log")
    ax_bw.set_ylabel("GB/s (bytes / p50)")
    ax_lat.set_ylabel("latency (ms)")
    cfg = report["config"]
    fig.suptitle(f"KV transfer, {cfg['model']} {cfg['dtype']}, UCX err mode "
                 f"{cfg['ucx_error_handling_mode']}, progress thread {cfg['progress_thread']} "
                 f"{cfg['ucx_env'] or ''}")  # fmt: skip
    ax_bw.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/kv_transfer.json"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    parser.add_argument("--iters", type=int, default=50, help="iterations at <= 16 MiB")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--error-mode", choices=("peer", "none"), default="peer")
    parser.add_argument(
        "--progress-thread",
        choices=("on", "off"),
        default="off",
        help="NIXL progress thread (busy-polls a core per agent); off: the caller progresses",
    )
    parser.add_argument("--role", choices=("initiator", "target"), default="initiator")
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if args.role == "target":
        run_target(msgspec.json.decode(args.config, type=Config))
        return
    report = run_initiator(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    logger.warning("wrote %s and %s", args.out, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()

"""KV moved between nodes of different tensor-parallel sizes (issue 31): bytes and
descriptors per destination rank, and the WRITE's time, for one prompt's blocks.

    python benchmarks/tp_kv.py --tokens 1024 --out benchmarks/results/tp_kv.json

Two real NIXL agents in this process (UCX over loopback TCP, progressed by this thread as
a node's engine loop progresses its own, no progress threads), each registering a node's
rank caches as a PD node of that TP size does (`KVRanks`, one agent per node). For each
(prefill TP, decode TP) pair the prompt's blocks (scattered: every other block) are
written `--iters` times after one warm-up; reported: bytes and descriptors each decode
rank receives (planned as the transport plans them, kv_transfer/tp_staging.py), whether
they go through a staging buffer, the median WRITE time (post to DONE: the gather into
staging, the registration and the transfer) and its rate. The default model's KV shape: SmolLM2-135M, 30 layers,
3 KV heads of 64, float32, 16-token blocks; its TP sizes are 1 and 3 (9 heads). A
Llama-3-8B-shaped cache (32 layers, 8 KV heads of 128, bf16) is planned only (no
transfer): bytes and descriptors per rank for TP 1, 2, 4, 8 and 16 (replicated heads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdserve.engine.kv_tensor import LAYER_MAJOR, KVRanks, allocate_kv_cache  # noqa: E402
from pdserve.kv_transfer.kv_layout import KVLayout  # noqa: E402
from pdserve.kv_transfer.tp_staging import plan, write_descs  # noqa: E402

BLOCK = 16


def heads_of(rank: int, tp: int, heads: int) -> tuple[int, int]:
    """(first KV head, count) of a rank, as engine/tp_shard.Shard shards them."""
    if heads >= tp:
        return rank * (heads // tp), heads // tp
    return rank // (tp // heads), 1


def node(tp, layers, blocks, heads, dim, dtype, layout=LAYER_MAJOR, meta=False) -> KVRanks:
    caches, starts = [], []
    for r in range(tp):
        start, n = heads_of(r, tp, heads)
        shape = (layers, 2, blocks, BLOCK, n, dim)
        c = torch.empty(shape, dtype=dtype, device="meta") if meta else None
        c = c if meta else allocate_kv_cache(layout, *shape[:1], blocks, BLOCK, n, dim, dtype=dtype)
        caches.append(c if meta else c.normal_())
        starts.append(start)
    return KVRanks(tuple(caches), tuple(starts), heads)


def layouts(ranks: KVRanks) -> list[KVLayout]:
    if ranks.caches[0].device.type != "meta":
        return KVLayout.of_ranks(ranks if len(ranks.caches) > 1 else ranks.caches[0])
    out = []
    for c, s in zip(ranks.caches, ranks.head_starts):
        layer, _, blocks, bs, heads, dim = c.shape
        out.append(
            KVLayout(layer, blocks, bs, heads, dim, "bfloat16", c.element_size(), "DRAM", 0,
                     1 << 30, kv_head_start=s, model_kv_heads=ranks.total_heads,
                     tp_size=len(ranks.caches))
        )  # fmt: skip
    return out


def per_rank(src: list[KVLayout], dst: list[KVLayout], src_ids, dst_ids) -> list[dict]:
    """Bytes and descriptors each dst rank receives (planned as the transport plans them,
    before coalescing), and whether its share is gathered into a staging buffer first."""
    src_ids, dst_ids = np.asarray(src_ids), np.asarray(dst_ids)
    rows = []
    for d, p in zip(dst, plan(src, dst)):
        local, _, _ = write_descs(None, src, [d], range(d.num_layers), src_ids, dst_ids)
        rows.append({"bytes": int(local[:, 1].sum()), "descriptors": int(local.shape[0]),
                     "staged": p.direct is None})  # fmt: skip
    return rows


def timed_write(a, b, name, src_ids, dst_ids, iters) -> list[float]:
    from pdserve.kv_transfer.nixl_transport import TransferState

    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        h = a.write_blocks(name, src_ids, dst_ids)
        deadline = t0 + 120
        while (state := a.poll(h)) is TransferState.PENDING and time.perf_counter() < deadline:
            b.get_notifs()  # both sides progress on this thread, as each node's loop does
        dt = time.perf_counter() - t0
        a.release(h)
        assert state is TransferState.DONE, state
        if i:  # the first is a warm-up
            times.append(dt)
    return times


def measured(args) -> list[dict]:
    from pdserve.kv_transfer.nixl_transport import NixlTransport

    n = -(-args.tokens // BLOCK)
    blocks = 2 * n + 2
    src_ids, dst_ids = list(range(0, 2 * n, 2)), list(range(1, 2 * n + 1, 2))
    out = []
    for ptp, dtp in [(1, 1), (1, 3), (3, 1), (3, 3)]:
        p = node(ptp, 30, blocks, 3, 64, torch.float32)
        d = node(dtp, 30, blocks, 3, 64, torch.float32)
        pick = lambda r: r if len(r.caches) > 1 else r.caches[0]  # noqa: E731
        kw = {"progress_thread": False}  # as in a node: no thread busy-polling a core
        with (
            NixlTransport(f"p{ptp}-{dtp}", pick(p), **kw) as a,
            NixlTransport(f"d{ptp}-{dtp}", pick(d), **kw) as b,
        ):
            name = a.add_peer(b.local_metadata())
            b.add_peer(a.local_metadata())
            ranks = per_rank(a.ranks, b.ranks, src_ids, dst_ids)
            times = timed_write(a, b, name, src_ids, dst_ids, args.iters)
        for r, c in enumerate(d.caches):  # every dst rank holds the src's heads
            start, k = d.head_starts[r], c.shape[4]
            src_full = torch.cat([p.caches[i][:, :, src_ids] for i in p.distinct], dim=4)
            assert torch.equal(c[:, :, dst_ids], src_full[..., start : start + k, :])
        total = sum(x["bytes"] for x in ranks)
        med = statistics.median(times)
        row = {"prefill_tp": ptp, "decode_tp": dtp, "tokens": args.tokens, "blocks": n,
               "per_decode_rank": ranks, "bytes_total": total,
               "descriptors_total": sum(x["descriptors"] for x in ranks),
               "write_s_median": med, "write_s": times, "gb_per_s": total / med / 1e9}  # fmt: skip
        print(json.dumps({k: v for k, v in row.items() if k != "write_s"}), flush=True)
        out.append(row)
    return out


def planned(args) -> list[dict]:
    n = -(-args.tokens // BLOCK)
    ids = list(range(n))
    out = []
    for ptp in (1, 2, 4, 8, 16):
        for dtp in (1, 2, 4, 8, 16):
            p = layouts(node(ptp, 32, n, 8, 128, torch.bfloat16, meta=True))
            d = layouts(node(dtp, 32, n, 8, 128, torch.bfloat16, meta=True))
            ranks = per_rank(p, d, ids, ids)
            out.append({"prefill_tp": ptp, "decode_tp": dtp, "tokens": args.tokens,
                        "bytes_per_decode_rank": ranks[0]["bytes"],
                        "descriptors_per_decode_rank": ranks[0]["descriptors"],
                        "bytes_total": sum(x["bytes"] for x in ranks)})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--plan-only", action="store_true", help="no NIXL transfer")
    ap.add_argument("--out", default="benchmarks/results/tp_kv.json")
    args = ap.parse_args()
    results = {"config": vars(args), "llama3_8b_planned": planned(args)}
    if not args.plan_only:
        results["smollm2_measured"] = measured(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

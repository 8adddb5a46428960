"""The LMCache adapter's copies on each KV cache layout: chunk rows <-> paged slots.

    python benchmarks/slot_copy.py --tokens 256 4096 --rounds 20 --out results/slot_copy.json

What differs between the LMCache rows of `pdserve bench kv` for a layer-major and a
block-major cache is only `pdserve.kv_transfer.kv_slots.SlotRows`: a run of slots is one strided
slice on a layer-major cache and one slice per block on a block-major one (a block holds
every layer's K and V). This times `read` (cache -> chunk, what a store copies out) and
`write` (chunk -> cache, what a retrieve copies in) for the same values in both layouts,
alternating, in SmolLM2-135M shapes (30 layers, 3 KV heads, head_dim 64, block 16, fp32),
source blocks in one run and destination blocks scattered (every other block, reversed).
Bytes are checked equal between the layouts. Reports the median ms and GB/s per case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pdserve.engine.kv_tensor import allocate_kv_cache  # noqa: E402
from pdserve.kv_transfer.kv_slots import SlotRows  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
LAYOUTS = ("layer_major", "block_major")


def measure(tokens: int, rounds: int) -> dict:
    nblocks = 2 * -(-tokens // BLOCK) + 1
    values = torch.randn(LAYERS, 2, nblocks, BLOCK, HEADS, HEAD_DIM)
    caches = {
        lay: allocate_kv_cache(lay, LAYERS, nblocks, BLOCK, HEADS, HEAD_DIM) for lay in LAYOUTS
    }
    for c in caches.values():
        c.copy_(values)
    run = torch.arange(tokens)  # source: one run of consecutive slots
    dst_blocks = list(range(nblocks - 1, 0, -2))[: -(-tokens // BLOCK)]
    scattered = torch.tensor([b * BLOCK + i for b in dst_blocks for i in range(BLOCK)][:tokens])
    chunks = {lay: torch.empty(LAYERS, 2, tokens, HEADS * HEAD_DIM) for lay in LAYOUTS}
    times: dict[str, list[float]] = {
        f"{op}_{lay}": [] for op in ("read", "write") for lay in LAYOUTS
    }
    for _ in range(rounds):
        for lay in LAYOUTS:
            rows = SlotRows(caches[lay])
            t = time.perf_counter()
            rows.read(chunks[lay], run)
            times[f"read_{lay}"].append(time.perf_counter() - t)
            t = time.perf_counter()
            rows.write(scattered, chunks[lay])
            times[f"write_{lay}"].append(time.perf_counter() - t)
    assert torch.equal(chunks["layer_major"], chunks["block_major"]), "layouts read differently"
    idx = scattered
    a, b = (caches[lay][:, :, idx // BLOCK, idx % BLOCK] for lay in LAYOUTS)
    assert torch.equal(a, b), "layouts wrote differently"
    nbytes = tokens * LAYERS * 2 * HEADS * HEAD_DIM * 4
    out = {"tokens": tokens, "bytes": nbytes}
    for k, v in times.items():
        med = statistics.median(v)
        out[k] = {"p50_ms": round(med * 1e3, 3), "gbps": round(nbytes / med / 1e9, 2)}
    for op in ("read", "write"):
        out[f"{op}_block_over_layer"] = round(
            out[f"{op}_block_major"]["p50_ms"] / out[f"{op}_layer_major"]["p50_ms"], 3
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default="results/slot_copy.json")
    args = ap.parse_args()
    rows = [measure(t, args.rounds) for t in args.tokens]
    for r in rows:
        print(json.dumps(r))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

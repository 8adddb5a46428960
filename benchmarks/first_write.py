"""The first NIXL WRITE to a new peer vs later ones, without and with connecting at hello.

    python benchmarks/first_write.py --out results/first_write.json

Two processes, as a prefill and a decode node: the target (decode) registers a
SmolLM2-shaped layer-major KV cache and progresses NIXL every 2 ms, as an idle decode
node's loop does; the initiator (prefill, no progress thread) adds it as a peer
(`NixlTransport.add_peer`, what a prefill node does on `PeerHello`: `connect` makes the
connection and progresses it for `--connect-ms`, `no_connect` does not), waits out
`--compute-ms` without progressing (the prompt's engine step), then times post -> DONE of
its first WRITE of `--blocks` consecutive blocks and of `--later` more. Each trial uses a
fresh initiator agent (a new connection); modes alternate trial by trial.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.kv_transfer.nixl_transport import CONNECT_S, NixlTransport, TransferState  # noqa: E402

MODES = ("no_connect", "connect")
SHAPE = (30, 2, 256, 16, 3, 64)  # layers, K/V, blocks, block size, kv heads, head dim


def _send(f, payload: bytes) -> None:
    f.write(struct.pack(">I", len(payload)) + payload)
    f.flush()


def _recv(f) -> bytes:
    (n,) = struct.unpack(">I", f.read(4))
    return f.read(n)


def target() -> None:
    """Child: register a KV cache, print its metadata, progress every 2 ms until stdin ends."""
    import os
    import select

    out = os.fdopen(os.dup(1), "wb")  # the metadata pipe; native libraries' prints -> stderr
    os.dup2(2, 1)
    with NixlTransport("fw-target", torch.zeros(SHAPE), progress_thread=False) as t:
        _send(out, t.local_metadata())
        fd = sys.stdin.fileno()
        while True:
            t.get_notifs()
            ready, _, _ = select.select([fd], [], [], 0.002)
            if ready and not os.read(fd, 1):
                return


def trial(md: bytes, name: str, mode: str, args) -> tuple[float, list[float]]:
    with NixlTransport(name, torch.ones(SHAPE), progress_thread=False) as t:
        end = time.perf_counter() + args.compute_ms / 1e3
        peer = t.add_peer(md, connect_s=args.connect_ms / 1e3 if mode == "connect" else 0.0)
        time.sleep(max(0.0, end - time.perf_counter()))  # the prompt's engine step
        times = []
        for i in range(1 + args.later):
            blocks = list(range(i * args.blocks % 128, i * args.blocks % 128 + args.blocks))
            t0 = time.perf_counter()
            h = t.write_blocks(peer, blocks, blocks)
            state = t.wait(h, timeout_s=30)
            times.append(time.perf_counter() - t0)
            t.release(h)
            assert state is TransferState.DONE, state
        return times[0], times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--later", type=int, default=5)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument("--connect-ms", type=float, default=CONNECT_S * 1e3)
    ap.add_argument("--out", default="results/first_write.json")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.target:
        return target()
    child = subprocess.Popen(
        [sys.executable, __file__, "--target"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        md = _recv(child.stdout)
        rows: dict[str, dict[str, list[float]]] = {
            m: {"first_ms": [], "later_ms": []} for m in MODES
        }
        for i in range(args.trials):
            for mode in rows:
                first, later = trial(md, f"fw-{mode}-{i}", mode, args)
                rows[mode]["first_ms"].append(first * 1e3)
                rows[mode]["later_ms"] += [x * 1e3 for x in later]
    finally:
        child.stdin.close()
        child.wait(30)
    summary = {
        mode: {f"{k}_median": round(statistics.median(v), 3) for k, v in r.items()}
        for mode, r in rows.items()
    }
    print(json.dumps(summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "summary": summary, "raw": rows}, indent=2))


if __name__ == "__main__":
    main()

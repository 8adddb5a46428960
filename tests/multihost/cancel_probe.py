"""One side of a cancelled NIXL WRITE between two hosts (tests/multihost/test_cancel.py).

    target    --dir D --blocks N --for-s S    registers a zeroed KV tensor, writes its NIXL
              metadata to D/target.md, then progresses its agent (as a decode node's loop
              does, every few ms) for S s, printing one JSON line per sample: its monotonic
              time and how many bytes of the tensor are no longer zero (landed).
    initiator --dir D --blocks N --release-after R --after-s A [--stop]
              registers the same geometry filled with ones, adds the target as a peer,
              posts one WRITE of every block, progresses it for R s, then releases the
              handle (with --stop: `NixlTransport.stop_writes()` first) and goes on
              progressing its agent for A s, as the prefill node's engine loop goes on
              after a cancel. With --stop it then WRITEs its last 8 blocks, set to 2.0, to
              the same peer through the rebuilt agent (loading the target's metadata
              again if it changed). Prints JSON lines: "posted",
              "stopped", "released" (the state the handle had), "second", "done".
    target --fence: once D/fence exists, `NixlTransport.fence_incoming()` (as a decode
              node fencing a peer), printing "fenced"; it goes on sampling.

Both run the project's own `NixlTransport` with no progress thread, as the connector does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pdserve.kv_transfer.nixl_transport import NixlTransport
from pdserve.kv_transfer.transfer_types import TransferState

# [layers, K/V, blocks, block_size, kv heads, head_dim], fp32: 32 KiB per block and plane
GEOMETRY = (1, 2, 0, 16, 8, 64)


def kv_tensor(blocks: int, fill: float) -> torch.Tensor:
    shape = list(GEOMETRY)
    shape[2] = blocks
    return torch.full(shape, fill, dtype=torch.float32)


def emit(**kw) -> None:
    print(json.dumps({"t": time.monotonic(), **kw}), flush=True)


def target(args: argparse.Namespace) -> None:
    kv = kv_tensor(args.blocks, 0.0)
    raw = kv.view(torch.uint8).reshape(-1)
    with NixlTransport("probe-target", kv, progress_thread=False) as t:
        md = Path(args.dir) / "target.md"
        md.with_suffix(".tmp").write_bytes(t.local_metadata())
        md.with_suffix(".tmp").rename(md)
        end = time.monotonic() + args.for_s
        next_sample = 0.0
        fence, fenced = Path(args.dir) / "fence", False
        while time.monotonic() < end:
            if args.fence and not fenced and fence.exists():
                t.fence_incoming()
                fenced = True
                md.with_suffix(".tmp").write_bytes(t.local_metadata())  # a new worker address
                md.with_suffix(".tmp").rename(md)
                emit(fenced=t.incoming_fences, landed=int(raw.count_nonzero()))
            t.get_notifs()  # progresses the agent: what arrives is written
            now = time.monotonic()
            if now >= next_sample:
                emit(landed=int(raw.count_nonzero()))
                next_sample = now + args.sample_s
            time.sleep(0.002)
        tail = kv[:, :, args.blocks - 8 :]
        emit(landed=int(raw.count_nonzero()), final=True, tail_twos=bool((tail == 2.0).all()))


def warm_up(t: NixlTransport) -> None:
    deadline = time.monotonic() + 30
    while t.num_warming:
        for name, reason in t.progress_warmups():
            if reason is not None:
                sys.exit(f"warm-up of {name} failed: {reason}")
        if time.monotonic() > deadline:
            sys.exit("warm-up did not end")
        time.sleep(0.001)


def initiator(args: argparse.Namespace) -> None:
    kv = kv_tensor(args.blocks, 1.0)
    md = Path(args.dir) / "target.md"
    deadline = time.monotonic() + 60
    while not md.exists():
        if time.monotonic() > deadline:
            sys.exit("no target metadata")
        time.sleep(0.05)
    with NixlTransport("probe-initiator", kv, progress_thread=False) as t:
        first_md = md.read_bytes()
        peer = t.add_peer(first_md)
        warm_up(t)
        ids = list(range(args.blocks))
        handle = t.write_blocks(peer, ids, ids)
        emit(posted=handle.stats.bytes)
        end = time.monotonic() + args.release_after
        while time.monotonic() < end and t.poll(handle) is TransferState.PENDING:
            time.sleep(0.001)
        state = t.poll(handle).name
        if args.stop:
            stopped = t.stop_writes()
            emit(stopped=stopped, state=t.poll(handle).name)
        t.release(handle)
        emit(released=state)
        end = time.monotonic() + args.after_s
        while time.monotonic() < end:
            t.get_notifs()
            time.sleep(0.002)
        if args.stop:  # the rebuilt agent carries the next WRITE to the same peer
            if md.read_bytes() != first_md:  # the target fenced: its new address
                t.progress_warmups()  # the old address's failure, if reported: expected
                peer = t.add_peer(md.read_bytes())
                warm_up(t)
            tail = list(range(args.blocks - 8, args.blocks))
            kv[:, :, tail] = 2.0
            handle = t.write_blocks(peer, tail, tail)
            emit(second_posted=True)
            end = time.monotonic() + 60
            while t.poll(handle) is TransferState.PENDING and time.monotonic() < end:
                time.sleep(0.001)
            emit(second=t.poll(handle).name)
            t.release(handle)
        emit(done=True, inflight=t.num_inflight)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["target", "initiator"])
    p.add_argument("--dir", required=True)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--for-s", type=float, default=20.0)
    p.add_argument("--sample-s", type=float, default=0.05)
    p.add_argument("--release-after", type=float, default=1.0)
    p.add_argument("--after-s", type=float, default=8.0)
    p.add_argument("--stop", action="store_true", help="stop_writes() before the release")
    p.add_argument(
        "--fence", action="store_true", help="target: fence_incoming() once D/fence exists"
    )
    args = p.parse_args(argv)
    (target if args.role == "target" else initiator)(args)


if __name__ == "__main__":
    main()

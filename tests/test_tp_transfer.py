"""KV between nodes of different tensor-parallel sizes, at the transport (real NIXL agents).

A TP node's connector registers every rank's cache (`KVRanks`, each rank holding some KV
heads) with one NIXL agent. A WRITE from a node of TP a to one of TP b must land each KV
head of each block in every rank that holds it, bit-exact, touch nothing else, and leave
the one-device checksum of each block unchanged; a peer whose heads do not add up to ours
is refused when it is added, naming both TP sizes.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

pytest.importorskip("nixl")

from pdserve.engine.kv_checksum import block_checksums  # noqa: E402
from pdserve.engine.kv_tensor import BLOCK_MAJOR, LAYER_MAJOR, KVRanks, allocate_kv_cache  # noqa: E402
from pdserve.kv_transfer.nixl_transport import NixlTransport, TransferState  # noqa: E402
from pdserve.kv_transfer.transfer_types import PeerMetadata  # noqa: E402

LAYERS, BLOCKS, BS, D = 3, 12, 4, 8
SENTINEL = -7.0
SRC, DST = [3, 4, 5, 9, 0], [7, 8, 9, 1, 11]


def heads_of(rank: int, tp: int, heads: int) -> tuple[int, int]:
    """(first KV head, count) of a rank, as engine/tp_shard.Shard shards them."""
    if heads >= tp:
        return rank * (heads // tp), heads // tp
    return rank // (tp // heads), 1


def split(full: torch.Tensor, tp: int, layout: str) -> KVRanks:
    """The rank caches of a TP node holding `full` (`[L, 2, N, bs, H, D]`)."""
    caches, starts = [], []
    for r in range(tp):
        start, n = heads_of(r, tp, full.shape[4])
        c = allocate_kv_cache(layout, LAYERS, BLOCKS, BS, n, D)
        c.copy_(full[..., start : start + n, :])
        caches.append(c)
        starts.append(start)
    return KVRanks(tuple(caches), tuple(starts), full.shape[4])


def node_kv(ranks: KVRanks):
    """What a node registers: the tensor itself for one device, every rank for TP."""
    return ranks if len(ranks.caches) > 1 else ranks.caches[0]


def write(a: NixlTransport, b: NixlTransport, src, dst, **kw) -> None:
    name = a.add_peer(b.local_metadata())
    b.add_peer(a.local_metadata())
    h = a.write_blocks(name, src, dst, notif=b"landed", **kw)
    assert a.wait(h, timeout_s=30) is TransferState.DONE
    a.release(h)
    deadline = time.monotonic() + 10
    got: dict = {}
    while not got and time.monotonic() < deadline:
        got = b.get_notifs()
    assert got == {a.name: [b"landed"]}
    return h


@pytest.mark.parametrize("layout", [LAYER_MAJOR, BLOCK_MAJOR])
@pytest.mark.parametrize(
    "heads,src_tp,dst_tp",
    [(4, 1, 2), (4, 2, 1), (4, 2, 2), (4, 1, 4), (4, 4, 2), (2, 1, 4), (2, 4, 1), (1, 2, 1)],
)
def test_blocks_land_in_every_rank_that_holds_their_heads(heads, src_tp, dst_tp, layout):
    torch.manual_seed(heads * 100 + src_tp * 10 + dst_tp)
    full = torch.randn(LAYERS, 2, BLOCKS, BS, heads, D)
    src = split(full, src_tp, layout)
    dst = split(torch.full_like(full, SENTINEL), dst_tp, layout)
    tag = f"{heads}-{src_tp}-{dst_tp}-{layout}"
    with NixlTransport(f"src-{tag}", node_kv(src)) as a:
        with NixlTransport(f"dst-{tag}", node_kv(dst)) as b:
            h = write(a, b, SRC, DST)
        # a dst rank holding exactly some src rank's heads is written straight from it
        same = all(
            (s, c.shape[4]) in {(t, e.shape[4]) for t, e in zip(src.head_starts, src.caches)}
            for s, c in zip(dst.head_starts, dst.caches)
        )
        assert a.staged_writes == (0 if same else 1)
    # whole blocks, directly or from a staging buffer: never a descriptor per token row
    assert h.stats.descriptors <= dst_tp * len(SRC) * (1 if layout == BLOCK_MAJOR else 6)
    assert a.num_staged == 0  # every staging buffer deregistered with its request
    untouched = [b for b in range(BLOCKS) if b not in DST]
    for r, c in enumerate(dst.caches):
        start, n = dst.head_starts[r], c.shape[4]
        for s, d in zip(SRC, DST, strict=True):
            assert torch.equal(c[:, :, d], full[:, :, s, :, start : start + n]), (r, s, d)
        assert bool((c[:, :, untouched] == SENTINEL).all())
    one = full.clone()
    assert block_checksums(src, SRC) == block_checksums(one, SRC) == block_checksums(dst, DST)
    assert block_checksums(dst, DST, rows=[1, 2, 3, 4, 1]) == block_checksums(
        one, SRC, rows=[1, 2, 3, 4, 1]
    )


def test_a_layer_range_moves_only_those_layers():
    torch.manual_seed(1)
    full = torch.randn(LAYERS, 2, BLOCKS, BS, 4, D)
    src, dst = split(full, 1, LAYER_MAJOR), split(torch.full_like(full, SENTINEL), 2, LAYER_MAJOR)
    with NixlTransport("src-layers", node_kv(src)) as a:
        with NixlTransport("dst-layers", node_kv(dst)) as b:
            h = write(a, b, [2, 3], [5, 6], layers=range(1, 2))
            assert a.num_staged == 0
    assert h.stats.descriptors == 2 * 2  # ranks x (K, V): blocks 5, 6 are one run
    for r, c in enumerate(dst.caches):
        start = dst.head_starts[r]
        assert torch.equal(c[1, :, [5, 6]], full[1, :, [2, 3], :, start : start + 2])
        assert bool((c[[0, 2]] == SENTINEL).all())


def test_a_peer_whose_heads_do_not_match_is_refused_naming_both_tp_sizes():
    ours = split(torch.zeros(LAYERS, 2, BLOCKS, BS, 4, D), 2, LAYER_MAJOR)
    other = split(torch.zeros(LAYERS, 2, BLOCKS, BS, 2, D), 1, LAYER_MAJOR)
    with NixlTransport("tp2-a", node_kv(ours)) as a, NixlTransport("tp1-b", node_kv(other)) as b:
        with pytest.raises(ValueError, match="tensor_parallel_size: ours 2, peer's 1"):
            a.add_peer(b.local_metadata())
        assert a.peers == []


@pytest.mark.parametrize(
    "forge",
    [
        lambda r: [r[0]],  # TP 2 announced, one rank described
        lambda r: [r[0], msgspec.structs.replace(r[1], kv_head_start=3)],  # past the heads
        lambda r: [r[0], msgspec.structs.replace(r[1], kv_head_start=0)],  # heads 2, 3 unheld
        lambda r: [r[0], msgspec.structs.replace(r[1], num_blocks=BLOCKS + 1)],
    ],
)
def test_forged_rank_layouts_are_refused(forge):
    ours = split(torch.zeros(LAYERS, 2, BLOCKS, BS, 4, D), 1, LAYER_MAJOR)
    peer = split(torch.zeros(LAYERS, 2, BLOCKS, BS, 4, D), 2, LAYER_MAJOR)
    with NixlTransport("victim", node_kv(ours)) as a, NixlTransport("forger", node_kv(peer)) as b:
        md = msgspec.msgpack.decode(b.local_metadata(), type=PeerMetadata)
        forged = msgspec.structs.replace(md, ranks=tuple(forge(list(md.ranks))))
        with pytest.raises(ValueError):
            a.add_peer(msgspec.msgpack.encode(forged))
        assert a.peers == []

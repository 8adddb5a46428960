"""LMCache on a block-major KV cache (real LMCache, real redis-server, in process).

A block-major block holds every layer's K and V together, so a chunk's token rows come
from (and go back to) one slice per block instead of one per run of blocks. The chunks are
the same bytes whichever layout wrote them: they round-trip bit for bit between any two
layouts, and an engine on a block-major cache reuses a prefix another node stored, with
greedy output equal to Hugging Face's. (PD through LMCache on block-major:
tests/test_lmcache_pd.py.)
"""

import random
import time

import pytest
import torch

from pdserve.engine.kv_tensor import allocate_kv_cache
from pdserve.engine.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, load_hf
from tests.store_engine import BS, CHUNK, NUM_BLOCKS, run, store_core

pytest.importorskip("lmcache")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LAYERS, BLOCKS, HEADS, HEAD_DIM = 3, 32, 2, 8


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


def rows(cache: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """[L, 2, len(slots), H, D] rows of the logical cache, whatever its storage order."""
    idx = torch.tensor(slots)
    return cache[:, :, idx // BS, idx % BS]


@pytest.mark.parametrize(
    "src_layout,dst_layout,fast",
    [
        ("block_major", "block_major", True),
        ("block_major", "block_major", False),  # LMCache's own remote read + to_gpu
        ("layer_major", "block_major", True),
        ("block_major", "layer_major", False),
    ],
)
def test_chunks_round_trip_bit_exact_between_layouts(src_layout, dst_layout, fast, redis_server):
    from pdserve.kv_transfer.lmcache_store import LMCacheKVStore

    def cache(layout: str) -> torch.Tensor:
        return allocate_kv_cache(layout, LAYERS, BLOCKS, BS, HEADS, HEAD_DIM, dtype=torch.float32)

    src, dst = cache(src_layout), cache(dst_layout)
    assert src.is_contiguous() == (src_layout == "layer_major")
    src.copy_(torch.randn(src.shape))
    kw = dict(namespace="bm", chunk_size=CHUNK, local_cpu_bytes=16 << 20)
    a = LMCacheKVStore(src, remote_url=redis_server.url, **kw)
    b = LMCacheKVStore(dst, remote_url=redis_server.url, fast_retrieve=fast, **kw)
    try:
        toks = prompt(45, seed=11)
        # source blocks 4.. with a break (a run of 3 blocks, then scattered ones)
        src_blocks = [4, 5, 6, 12, 9, 20, 21, 1, 30, 2, 17, 25]
        dst_blocks = [30, 2, 17, 5, 9, 21, 22, 3, 26, 14, 7, 19]
        src_slots = [blk * BS + i for blk in src_blocks for i in range(BS)][:45]
        dst_slots = [blk * BS + i for blk in dst_blocks for i in range(BS)][:45]
        # a run starting mid-block crosses block boundaries: slots 6.. of block 1, 2, ...
        assert a.store(toks, src_slots) == 45
        assert a.wait_visible(toks, time.monotonic() + 30)
        assert b.lookup(toks) == 45
        assert b.retrieve(toks, dst_slots, skip_tokens=20) == 45
        assert torch.equal(rows(dst, dst_slots[20:]), rows(src, src_slots[20:]))
        assert not rows(dst, dst_slots[:20]).any()  # present locally: never overwritten
        others = [blk for blk in range(BLOCKS) if blk not in dst_blocks]
        assert not dst[:, :, others].any()  # no byte outside the destination slots
    finally:
        a.close()
        b.close()


def test_runs_inside_and_across_blocks_copy_exact_rows():
    """SlotRows on a block-major cache: runs that start mid-block, span whole blocks (one
    copy) and end mid-block; -1 slots left alone on write and refused on read."""
    from pdserve.kv_transfer.kv_slots import SlotRows

    bm = allocate_kv_cache("block_major", LAYERS, 8, BS, HEADS, HEAD_DIM, dtype=torch.float32)
    bm.copy_(torch.randn(bm.shape))
    # 2..14: half of block 0, blocks 1 and 2 whole, 3 of block 3; then 30, 31; then 21
    slots = list(range(2, 15)) + [30, 31, 21]
    sr = SlotRows(bm)
    assert [(off, k, v.dim()) for off, k, v in sr.pieces(2, 13)] == [
        (0, 2, 4),
        (2, 8, 5),
        (10, 3, 4),
    ]
    chunk = torch.zeros(LAYERS, 2, len(slots), HEADS * HEAD_DIM)
    sr.read(chunk, torch.tensor(slots))
    assert torch.equal(chunk.view(LAYERS, 2, len(slots), HEADS, HEAD_DIM), rows(bm, slots))
    with pytest.raises(ValueError, match="no slot"):
        sr.read(chunk, torch.tensor([-1] + slots[1:]))
    back = torch.zeros_like(bm)
    SlotRows(back).write(torch.tensor([-1] + slots[1:]), chunk)
    assert torch.equal(rows(back, slots[1:]), rows(bm, slots[1:]))
    assert not rows(back, [2]).any()  # -1: left alone
    assert int((back != 0).sum()) == (len(slots) - 1) * LAYERS * 2 * HEADS * HEAD_DIM


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


@pytest.mark.parametrize("saver_layout", ["block_major", "layer_major"])
def test_block_major_engine_loads_a_stored_prefix_hf_exact(
    saver_layout, tiny_llama_dir, hf_model, redis_server
):
    """Node A (either layout) computes and saves a prompt; node B on a block-major cache
    loads its 3 whole chunks from Redis, computes only the tail, and answers like HF."""
    url = [(redis_server.url, ("load", "save"))]
    a = store_core(tiny_llama_dir, url, layout=saver_layout)
    b = store_core(tiny_llama_dir, url, layout="block_major")
    assert not b.runner.kv_cache.is_contiguous()  # really a block-major cache
    try:
        p = prompt(50, seed=1)
        out_a, cached_a = run(a, "a", p, GREEDY)
        assert cached_a == 0 and a.kv_store.backend_stats()["s0"]["kv_store_saves"] == 1
        q = p[:48] + prompt(7, seed=2)  # same 48-token prefix, another tail
        out_b, cached_b = run(b, "b", q, GREEDY)
        assert cached_b == 48
        assert b.kv_store.backend_stats()["s0"]["served_tokens"] == 48
        assert out_a == hf_greedy(hf_model, p, GREEDY.max_tokens)
        assert out_b == hf_greedy(hf_model, q, GREEDY.max_tokens)
        for core in (a, b):
            core.check_integrity()
            assert core.kv.num_free_blocks == NUM_BLOCKS
    finally:
        a.kv_store.shutdown()
        b.kv_store.shutdown()

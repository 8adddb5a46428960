"""BlockPool and KVCacheManager: references, prefix cache, LRU eviction, integrity."""

import pytest

from pdserve.common.block_hash import hash_block_tokens, hash_prompt_blocks, root_hash
from pdserve.engine.block_pool import BlockPool, BlockPoolError
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

ROOT = root_hash("test", 4)


def test_alloc_free_and_integrity():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    pool.check_integrity()
    pool.free_blocks(a)
    assert pool.num_free_blocks == 8
    pool.check_integrity()
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free_blocks(a[:1])
    with pytest.raises(BlockPoolError, match="only 8 free"):
        pool.get_new_blocks(9)


def test_cache_hit_confirms_token_ids():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(ROOT, [1, 2, 3, 4])
    pool.cache_full_block(b, h, [1, 2, 3, 4])
    assert pool.get_cached_block(h, [1, 2, 3, 4]) is b
    # A forged collision: same hash, other tokens -> no hit.
    assert pool.get_cached_block(h, [9, 9, 9, 9]) is None


def test_lru_eviction_of_free_cached_blocks():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block_tokens(ROOT, [i]) for i in range(3)]
    for b, h, t in zip(blocks, hashes, range(3)):
        pool.cache_full_block(b, h, [t])
    pool.free_blocks([blocks[1], blocks[0], blocks[2]])  # free order = LRU order
    assert pool.num_cached_blocks == 3
    (new,) = pool.get_new_blocks(1)
    assert new is blocks[1]  # least recently freed is evicted first
    assert pool.get_cached_block(hashes[1], [1]) is None
    assert pool.get_cached_block(hashes[0], [0]) is blocks[0]
    # A hit on a free cached block takes it out of the free queue.
    pool.touch([blocks[0]])
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_chained_hashes_depend_on_prefix():
    a = hash_prompt_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, ROOT)
    b = hash_prompt_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4, ROOT)
    assert len(a) == 2 and a[1] != b[1]
    assert hash_prompt_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, ROOT) == a  # partial block


def test_hash_root_is_keyed_by_model_and_block_size():
    tokens = list(range(16))
    chains = {
        (m, bs): hash_prompt_blocks(tokens, bs, root_hash(m, bs))
        for m in ("model-a", "model-b")
        for bs in (4, 8)
    }
    firsts = {chain[0] for chain in chains.values()}
    assert len(firsts) == 4  # no two (model, block size) pairs share a block hash
    # The engine's Request computes the same chain as the router's helper.
    r = Request("a", tokens, SamplingParams(), 4, hash_root=root_hash("model-a", 4))
    assert r.block_hashes == chains[("model-a", 4)]


def test_manager_prefix_reuse_and_free():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    params = SamplingParams(max_tokens=1)
    r1 = Request("a", list(range(10)), params, 4)
    computed, n = kv.get_computed_blocks(r1)
    assert n == 0
    assert kv.allocate_slots(r1, 10) is not None
    assert len(kv.get_block_ids("a")) == 3
    r2 = Request("b", list(range(9)) + [99, 98], params, 4)
    computed, n = kv.get_computed_blocks(r2)
    assert n == 8 and [b.block_id for b in computed] == kv.get_block_ids("a")[:2]
    r2.num_computed_tokens = n
    kv.allocate_slots(r2, 3, computed)
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.pool.blocks[kv.get_block_ids("a")[0]].ref_cnt == 2
    kv.check_integrity()
    kv.free(r1)
    kv.free(r2)
    kv.check_integrity()
    assert kv.num_free_blocks == 10


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = Request("a", list(range(12)), SamplingParams(), 4)
    assert kv.allocate_slots(r, 12) is None
    assert kv.num_free_blocks == 2 and kv.get_block_ids("a") == []
    kv.check_integrity()


def _fragmented_pool() -> BlockPool:
    """16 blocks; free in LRU order 1, 3, 5, then 9..15 (a run of 7), then 0 (0-1: a run)."""
    pool = BlockPool(16)
    blocks = pool.get_new_blocks(16)
    pool.free_blocks([blocks[i] for i in (1, 3, 5)])
    pool.free_blocks(blocks[9:])
    pool.free_blocks([blocks[0]])
    return pool


def test_blocks_in_runs_take_the_longest_run_not_the_lru_order():
    pool = _fragmented_pool()
    assert [b.block_id for b in pool.get_new_blocks(4)] == [1, 3, 5, 9]  # LRU: scattered
    pool = _fragmented_pool()
    got = pool.get_new_blocks_in_runs(4)
    assert [b.block_id for b in got] == [9, 10, 11, 12]
    assert all(b.ref_cnt == 1 for b in got)
    pool.check_integrity()
    # more than the longest run: the rest comes from the next longest runs
    got = pool.get_new_blocks_in_runs(6)
    assert [b.block_id for b in got] == [13, 14, 15, 0, 1, 3]
    pool.check_integrity()
    with pytest.raises(BlockPoolError, match="only 1 free"):
        pool.get_new_blocks_in_runs(2)


def test_blocks_in_runs_continue_after_the_last_block():
    pool = _fragmented_pool()
    assert [b.block_id for b in pool.get_new_blocks_in_runs(3, after=10)] == [11, 12, 13]
    assert [b.block_id for b in pool.get_new_blocks_in_runs(3, after=13)] == [14, 15, 0]
    pool.check_integrity()


def test_blocks_in_runs_spare_cached_blocks_while_uncached_suffice():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(8)
    h = hash_block_tokens(ROOT, [1, 2, 3, 4])
    pool.cache_full_block(blocks[0], h, [1, 2, 3, 4])
    pool.free_blocks(blocks)
    got = pool.get_new_blocks_in_runs(7)
    assert sorted(b.block_id for b in got) == list(range(1, 8))
    assert pool.get_cached_block(h, [1, 2, 3, 4]) is blocks[0]  # still cached
    pool.free_blocks(got)
    got = pool.get_new_blocks_in_runs(8)  # now it needs the cached block too
    assert [b.block_id for b in got] == list(range(8))
    assert pool.get_cached_block(h, [1, 2, 3, 4]) is None and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_pd_allocations_are_runs_on_a_fragmented_pool():
    kv = KVCacheManager(16, 4, enable_caching=False)
    params = SamplingParams(max_tokens=1)
    one = [Request(f"r{i}", [i] * 4, params, 4) for i in range(16)]
    for r in one:  # one block each: r{i} holds block i
        kv.allocate_slots(r, 4)
    for i in (1, 3, 5, *range(9, 16), 0):  # the same free order as _fragmented_pool
        kv.free(one[i])
    remote = Request("d", list(range(100, 124)), params, 4)  # 6 blocks, KV from a peer
    assert kv.allocate_slots(remote, 24, cache=False) is not None
    assert kv.get_block_ids("d") == [9, 10, 11, 12, 13, 14]
    export = Request("p", list(range(200, 208)), params, 4)
    export.kv_export = True  # a prefill order: chunk by chunk, the run continues
    kv.allocate_slots(export, 4)
    export.num_computed_tokens = 4
    kv.allocate_slots(export, 4)
    assert kv.get_block_ids("p") == [0, 1]
    local = Request("c", list(range(300, 304)), params, 4)
    kv.allocate_slots(local, 4)
    assert kv.get_block_ids("c") == [3]  # everything else keeps the LRU order
    kv.check_integrity()

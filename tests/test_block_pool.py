"""BlockPool and KVCacheManager: references, prefix cache, LRU eviction, integrity."""

import pytest

from cluster.block_hash import hash_block_tokens, hash_prompt_blocks, root_hash
from engine.block_pool import BlockPool, BlockPoolError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

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

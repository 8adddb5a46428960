"""PD through the LMCache connector: prefill stores the prompt's chunks in Redis, decode
retrieves them by token ids (real redis-server, real lmcache, two engines in one process).

The same contract as the NIXL connector: greedy output equal to colocated and to HF; a
decode request whose KV never comes ends at its deadline (local prefill, or an error)
with every block freed; an abort frees both sides; KV missing from the store (the
completeness check) falls back to a local prefill instead of decoding from holes.
"""

import random
import time

import pytest

from pdserve.common.errors import ConfigError
from pdserve.decode.role import DecodeRole
from pdserve.engine.config import (
    CacheConfig,
    EngineConfig,
    KVStoreConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from pdserve.engine.core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.lmcache_connector import LMCacheSettings, lmcache_connector
from pdserve.prefill.role import PrefillRole
from tests.hf_reference import hf_greedy, load_hf

pytest.importorskip("lmcache")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BS, CHUNK = 4, 16


def make_config(model_dir, budget=32, layout="layer_major") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_dir),
        cache=CacheConfig(block_size=BS, num_blocks=256, kv_layout=layout),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, local_prefill_max_tokens=4),
        num_threads=1,
    )


class Pair:
    def __init__(
        self,
        model_dir,
        url,
        timeout_s=60.0,
        prefill_locally=True,
        budget=32,
        layouts=("layer_major", "layer_major"),  # (prefill's, decode's)
    ):
        s = LMCacheSettings(url, "tiny", chunk_size=CHUNK, local_cpu_bytes=32 << 20)
        self.pconn = lmcache_connector(
            node_id="p", role="prefill", lmcache=s, control_address="tcp://127.0.0.1:*"
        )
        pcfg, dcfg = (make_config(model_dir, budget, layout) for layout in layouts)
        self.prefill = EngineCore(pcfg, PrefillRole(self.pconn))
        self.dconn = lmcache_connector(node_id="d", role="decode", lmcache=s)
        self.drole = DecodeRole(
            self.dconn, transfer_timeout_s=timeout_s, prefill_locally_on_failure=prefill_locally
        )
        self.decode = EngineCore(dcfg, self.drole)
        self.addr = self.pconn.control_address

    def run(self, prompts, max_s=120.0, step_prefill=True, rid="r"):
        outs: dict[str, list] = {}
        for i, p in enumerate(prompts):
            self.decode.add_request(f"{rid}{i}", p, GREEDY, remote_prefill=self.addr)
        deadline = time.monotonic() + max_s
        while self.decode.has_unfinished or (step_prefill and self.prefill.has_unfinished):
            assert time.monotonic() < deadline, "PD pair did not finish"
            for o in self.decode.step():
                outs.setdefault(o.request_id, []).append(o)
            if step_prefill:
                assert self.prefill.step() == []
            else:
                time.sleep(0.001)
        return [outs[f"{rid}{i}"] for i in range(len(prompts))]

    def assert_clean(self):
        for core in (self.decode, self.prefill):
            core.check_integrity()
            assert core.kv.pool.num_used_blocks == 0

    def close(self):
        self.drole.shutdown()
        self.prefill.kv_role.shutdown()


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def prompts_of(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


def colocated(model_dir, prompts):
    core = EngineCore(make_config(model_dir))
    for i, p in enumerate(prompts):
        core.add_request(f"c{i}", p, GREEDY)
    out: dict[str, list[int]] = {}
    while core.has_unfinished:
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"c{i}"] for i in range(len(prompts))]


def test_pd_via_lmcache_equals_colocated_and_hf(tiny_llama_dir, hf_model, redis_server):
    pair = Pair(tiny_llama_dir, redis_server.url)
    try:
        prompts = prompts_of([9, 40, 77, 16, 33], seed=1)  # partial and whole chunks
        results = [tokens(o) for o in pair.run(prompts)]
        assert results == colocated(tiny_llama_dir, prompts)
        assert results == [hf_greedy(hf_model, p, 8) for p in prompts]
        assert pair.drole.num_remote_prefills == 5 and pair.drole.num_failures == 0
        # 40- and 77-token prompts run over several 32-token steps: their whole chunks
        # were stored while later chunks computed (pipelined), and still arrived exact.
        assert pair.pconn.early_stores >= 2
        assert pair.decode.stats().kv_bytes_received > 0
        pair.assert_clean()

        # The decode node holds 20 tokens (5 blocks) of the next prompt: it orders from
        # block 5, which is inside chunk 1; the prefill node stores from the chunk start,
        # the decode node loads only blocks 5.. and leaves its cached blocks untouched.
        shared = prompts[1][:20]
        pair.run([shared + [5, 6]], rid="warm")
        p2 = shared + prompts_of([25], seed=2)[0]
        (outs,) = pair.run([p2], rid="hit")
        assert tokens(outs) == hf_greedy(hf_model, p2, 8)
        assert outs[0].num_cached_tokens == 20
        assert pair.drole.num_failures == 0
        pair.assert_clean()
    finally:
        pair.close()


@pytest.mark.parametrize(
    "layouts", [("block_major", "block_major"), ("block_major", "layer_major")]
)
def test_pd_via_lmcache_on_block_major_equals_hf(layouts, tiny_llama_dir, hf_model, redis_server):
    """Prefill on a block-major cache stores chunks read from its blocks (each holds every
    layer's K and V); the decode node (block-major, or layer-major: chunks are the same
    bytes) retrieves them into scattered blocks and answers exactly like HF."""
    pair = Pair(tiny_llama_dir, redis_server.url, layouts=layouts)
    try:
        assert [not c.runner.kv_cache.is_contiguous() for c in (pair.prefill, pair.decode)] == [
            layout == "block_major" for layout in layouts
        ]
        prompts = prompts_of([9, 40, 77, 33], seed=8)  # partial and whole chunks
        results = [tokens(o) for o in pair.run(prompts)]
        assert results == [hf_greedy(hf_model, p, 8) for p in prompts]
        assert pair.drole.num_remote_prefills == 4 and pair.drole.num_failures == 0
        assert pair.pconn.early_stores >= 2  # chunks stored while later ones computed
        pair.assert_clean()
    finally:
        pair.close()


def test_kv_that_never_comes_ends_at_the_deadline(tiny_llama_dir, hf_model, redis_server):
    pair = Pair(tiny_llama_dir, redis_server.url, timeout_s=0.5)
    try:
        p = prompts_of([30], seed=4)[0]
        t0 = time.monotonic()
        (outs,) = pair.run([p], step_prefill=False)  # the prefill node never stores
        assert time.monotonic() - t0 < 60
        assert tokens(outs) == hf_greedy(hf_model, p, 8)  # prefilled locally after it
        assert pair.drole.num_failures == 1
        pair.decode.check_integrity()
        assert pair.decode.kv.pool.num_used_blocks == 0  # held blocks released after grace
    finally:
        pair.close()


def test_deadline_with_error_policy_ends_the_request(tiny_llama_dir, redis_server):
    pair = Pair(tiny_llama_dir, redis_server.url, timeout_s=0.3, prefill_locally=False)
    try:
        (outs,) = pair.run([prompts_of([30], seed=5)[0]], step_prefill=False)
        assert outs[-1].finish_reason == "error" and "within" in outs[-1].error
        pair.decode.check_integrity()
        assert pair.decode.kv.pool.num_used_blocks == 0
    finally:
        pair.close()


def test_chunks_missing_from_the_store_fall_back_to_local(tiny_llama_dir, hf_model, redis_server):
    import redis

    pair = Pair(tiny_llama_dir, redis_server.url)
    try:
        p = prompts_of([50], seed=6)[0]
        pair.decode.add_request("x", p, GREEDY, remote_prefill=pair.addr)
        deadline = time.monotonic() + 60
        prole = pair.prefill.kv_role
        while prole.num_orders == 0:  # until the prefill node took the order
            assert time.monotonic() < deadline
            pair.decode.step()
            pair.prefill.step()
        while pair.prefill.has_unfinished or prole.has_pending():
            assert time.monotonic() < deadline
            pair.prefill.step()
        # Stored and announced; the chunks vanish before the decode node reads them.
        redis.Redis.from_url(redis_server.url).flushall()
        out = []
        while pair.decode.has_unfinished:
            assert time.monotonic() < deadline
            out += [t for o in pair.decode.step() for t in o.new_token_ids]
        assert out == hf_greedy(hf_model, p, 8)
        assert pair.drole.num_failures == 1  # "incomplete KV in the store": prefilled here
        pair.assert_clean()
    finally:
        pair.close()


def test_abort_mid_prefill_frees_both_sides(tiny_llama_dir, redis_server):
    pair = Pair(tiny_llama_dir, redis_server.url, budget=4)  # many 4-token steps
    try:
        p = prompts_of([120], seed=7)[0]
        pair.decode.add_request("a", p, GREEDY, remote_prefill=pair.addr)
        deadline = time.monotonic() + 30
        while not (
            "a@1" in pair.prefill.requests and pair.prefill.requests["a@1"].num_computed_tokens >= 8
        ):
            assert time.monotonic() < deadline
            pair.decode.step()
            pair.prefill.step()
        pair.decode.abort_requests(["a"])
        while pair.decode.has_unfinished or pair.prefill.has_unfinished:
            assert time.monotonic() < deadline
            pair.decode.step()
            pair.prefill.step()
        pair.assert_clean()
        assert "a@1" not in pair.prefill.requests
    finally:
        pair.close()


def test_lmcache_connector_needs_the_shared_redis(tiny_llama_dir):
    with pytest.raises(ConfigError, match="kv_store.remote_url"):
        EngineConfig(
            model=ModelConfig(tiny_llama_dir),
            kv_transfer=KVTransferConfig(role="decode", connector="lmcache"),
        )
    with pytest.raises(ConfigError, match="kv_transfer.connector"):
        KVTransferConfig(role="decode", connector="carrier-pigeon")
    cfg = EngineConfig(
        model=ModelConfig(tiny_llama_dir),
        cache=CacheConfig(block_size=4),
        kv_transfer=KVTransferConfig(role="decode", connector="lmcache"),
        kv_store=KVStoreConfig(remote_url="redis://127.0.0.1:1", chunk_size=16),
    )
    assert cfg.kv_transfer.connector == "lmcache"

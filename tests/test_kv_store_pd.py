"""NIXL for the request's transfer, LMCache for prefix reuse, in one PD pair (in process).

Both nodes run the NIXL PD role and the LMCache prefix store over one redis-server. The
prefill node saves every prompt it computes; a decode node that has never seen a prompt
loads its stored prefix first, then orders only the rest from the prefill node over NIXL.
"""

import random
import time

import pytest

from pdserve.decode.role import DecodeRole
from pdserve.engine.config import (
    CacheConfig,
    EngineConfig,
    KVStoreConfig,
    ModelConfig,
    SchedulerConfig,
)
from pdserve.engine.core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.nixl_connector import nixl_connector
from pdserve.node.roles import build_kv_store
from pdserve.prefill.role import PrefillRole
from tests.hf_reference import hf_greedy, load_hf

pytest.importorskip("nixl")
pytest.importorskip("lmcache")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BS = 4


def config(model_dir, url) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_dir),
        cache=CacheConfig(block_size=BS, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, local_prefill_max_tokens=4),
        kv_store=KVStoreConfig(
            backend="lmcache", remote_url=url, chunk_size=16, local_cpu_bytes=64 << 20
        ),
        num_threads=1,
    )


def run(decode: EngineCore, prefill: EngineCore, rid: str, prompt, addr, max_s=90.0):
    decode.add_request(rid, prompt, GREEDY, remote_prefill=addr)
    out, deadline = [], time.monotonic() + max_s
    while decode.has_unfinished or prefill.has_unfinished:
        assert time.monotonic() < deadline, "PD pair did not finish"
        for o in decode.step():
            out += o.new_token_ids
        prefill.step()
    for core in (decode, prefill):
        core.check_integrity()
        assert core.kv.pool.num_used_blocks == 0
    return out


def test_decode_loads_stored_prefix_and_orders_only_the_rest(tiny_llama_dir, redis_server):
    hf = load_hf(tiny_llama_dir)
    cfg = config(tiny_llama_dir, redis_server.url)
    pconn = nixl_connector(node_id="p", role="prefill", control_address="tcp://127.0.0.1:*")
    prefill = EngineCore(cfg, PrefillRole(pconn), kv_store=build_kv_store(cfg))
    cores = [prefill]
    try:
        rng = random.Random(7)
        shared = [rng.randrange(3, 1024) for _ in range(48)]
        p1 = shared + [rng.randrange(3, 1024) for _ in range(5)]
        d1 = EngineCore(cfg, DecodeRole(nixl_connector(node_id="d1", role="decode")),
                        kv_store=build_kv_store(cfg))  # fmt: skip
        cores.append(d1)
        assert run(d1, prefill, "a", p1, pconn.control_address) == hf_greedy(hf, p1, 8)
        assert prefill.stats().kv_store_saves == 1  # the prefill node saved the prompt

        # A second decode node: 48 tokens = 3 chunks come from the store, the rest over NIXL.
        p2 = shared + [rng.randrange(3, 1024) for _ in range(30)]
        d2 = EngineCore(cfg, DecodeRole(nixl_connector(node_id="d2", role="decode")),
                        kv_store=build_kv_store(cfg))  # fmt: skip
        cores.append(d2)
        sent = prefill.kv_role.bytes_sent
        assert run(d2, prefill, "b", p2, pconn.control_address) == hf_greedy(hf, p2, 8)
        s = d2.stats()
        assert s.kv_store_hit_tokens == 48 and s.pd_remote_prefills == 1
        per_block = d2.kv_role.connector.data.layout.block_bytes * 2 * d2.arch.num_hidden_layers
        assert prefill.kv_role.bytes_sent - sent == (-(-78 // BS) - 48 // BS) * per_block
    finally:
        for core in cores:
            core.kv_role.shutdown()
            core.kv_store.shutdown()

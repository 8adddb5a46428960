"""A request aborted while it waits for a store load (real engine, real LMCache, real
redis-server): its blocks stay parked until the load settles, then go back to the pool,
and the engine goes idle, also when no load job runs (store down, save-only backend)."""

import pytest

from pdserve.cluster.embedded_redis import EmbeddedRedis
from pdserve.engine.core import EngineCore
from pdserve.engine.request import RequestStatus
from tests.store_engine import BS, PARAMS, run_idle, store_core

pytest.importorskip("lmcache")

PROMPT = list(range(5, 5 + 40))


def abort_waiting_load(core: EngineCore, rid: str, prompt: list[int] = PROMPT) -> int:
    """Admit `rid` for a store load, abort it; returns the free blocks before it came."""
    free0 = core.kv.num_free_blocks
    core.add_request(rid, prompt, PARAMS)
    core.step()  # admitted for a store load: the whole prompt's blocks, a load posted
    assert core.requests[rid].status == RequestStatus.WAITING_FOR_STORE
    core.end_request(rid, RequestStatus.FINISHED_ABORTED)
    # LoadSettled can only come in a later step: the load may still write the blocks
    assert core.kv.num_free_blocks <= free0 - len(PROMPT) // BS
    assert rid in core.store.parked
    return free0


def test_abort_while_loading_parks_blocks_until_settled(tiny_llama_dir, redis_server):
    core = store_core(tiny_llama_dir, [(redis_server.url, ("load", "save"))])
    try:
        free0 = abort_waiting_load(core, "r1")
        run_idle(core)
        assert core.store.parked == {}
        assert core.kv.num_free_blocks == free0
    finally:
        core.kv_store.shutdown()


def test_abort_when_the_store_is_down_settles_at_once(tiny_llama_dir):
    with EmbeddedRedis() as r:
        core = store_core(tiny_llama_dir, [(r.url, ("load", "save"))], retry_after_s=60)
        try:
            r.stop()  # the first load fails: the store is skipped for 60 s
            core.add_request("first", PROMPT, PARAMS)
            run_idle(core)
            assert core.kv_store.stats()["kv_store_load_failures"] == 1
            # The next load is answered without a job; aborting it must still settle.
            free0 = abort_waiting_load(core, "r2", [t + 100 for t in PROMPT])
            run_idle(core)
            assert core.store.parked == {}
            assert core.kv.num_free_blocks == free0
        finally:
            core.kv_store.shutdown()


def test_save_only_backend_never_waits_for_a_load(tiny_llama_dir, redis_server):
    core = store_core(tiny_llama_dir, [(redis_server.url, ("save",))])
    try:
        free0 = core.kv.num_free_blocks
        core.add_request("r1", PROMPT, PARAMS)
        core.step()
        assert core.requests["r1"].status != RequestStatus.WAITING_FOR_STORE
        core.end_request("r1", RequestStatus.FINISHED_ABORTED)
        run_idle(core)
        core.add_request("r2", PROMPT, PARAMS)
        run_idle(core)
        assert core.kv_store.stats()["kv_store_saves"] >= 1
        assert core.store.parked == {}
        assert core.kv.num_free_blocks == free0
    finally:
        core.kv_store.shutdown()

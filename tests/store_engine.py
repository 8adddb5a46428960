"""An EngineCore with LMCache store backends (real LMCache, real redis-server), stepped by
hand: the setup the KV store engine tests share."""

from __future__ import annotations

import time

from pdserve.engine.config import (
    CacheConfig,
    EngineConfig,
    KVBackendConfig,
    KVStoreConfig,
    ModelConfig,
    SchedulerConfig,
)
from pdserve.engine.core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.roles import build_kv

BS, CHUNK = 4, 16  # block size, LMCache chunk (4 blocks)
NUM_BLOCKS = 64
PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def store_core(
    model_dir: str,
    backends: list[tuple[str, tuple[str, ...]]],
    layout: str = "layer_major",
    **store: float,
) -> EngineCore:
    """An engine whose `kv_backends` are LMCache stores, one per (redis url, roles), named
    s0, s1, ... in order; `store` overrides KVStoreConfig fields (retry_after_s: 0 unless
    given, so a failed store is asked again at once)."""
    store.setdefault("retry_after_s", 0)
    cfg = EngineConfig(
        model=ModelConfig(model_dir),
        cache=CacheConfig(block_size=BS, num_blocks=NUM_BLOCKS, kv_layout=layout),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        kv_store=KVStoreConfig(chunk_size=CHUNK, local_cpu_bytes=16 << 20, **store),
        kv_backends=tuple(
            KVBackendConfig("lmcache", roles, remote_url=url, name=f"s{i}")
            for i, (url, roles) in enumerate(backends)
        ),
        num_threads=1,
    )
    _, kv_store = build_kv(cfg)
    return EngineCore(cfg, None, kv_store=kv_store)


def run_idle(core: EngineCore, deadline_s: float = 60.0) -> None:
    """Step `core` until it has nothing left to do (generous deadline: a loaded box)."""
    t0 = time.monotonic()
    while core.has_unfinished:
        assert time.monotonic() - t0 < deadline_s, f"engine still busy: {core.store.parked}"
        core.step()
        time.sleep(0.005)


def run(
    core: EngineCore, rid: str, prompt: list[int], params: SamplingParams = PARAMS
) -> tuple[list[int], int | None]:
    """Add one request and step until the engine is idle (its saves settled too); returns
    its tokens and the prompt tokens it did not compute (prefix cache + store)."""
    core.add_request(rid, prompt, params)
    tokens, cached, t0 = [], None, time.monotonic()
    while core.has_unfinished:
        assert time.monotonic() - t0 < 60, f"engine still busy: {core.store.parked}"
        for o in core.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
        time.sleep(0.005)
    return tokens, cached

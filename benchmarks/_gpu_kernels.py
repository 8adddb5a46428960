"""gpu_check sections on the Triton attention kernels: bandwidth, timing, huge caches."""

from __future__ import annotations

import logging

import torch

from benchmarks._gpu_common import Skip, time_ms

logger = logging.getLogger("gpu_check.kernels")
GOAL_PCT_PEAK = 70.0
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def sections(ctx: dict) -> list:
    return [
        ("kernels_decode_bandwidth", lambda: decode_bandwidth(ctx)),
        ("kernels_prefill_timing", lambda: prefill_timing(ctx)),
        ("kernels_huge_cache", lambda: huge_cache(ctx)),
    ]


def _paged(batch: int, context: int, kv_heads: int, head_dim: int, bs: int, device: str,
           first_block: int = 1, num_blocks: int | None = None):  # fmt: skip
    """bf16 caches and shuffled block tables over blocks [first_block, first_block + need)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    per_seq = -(-context // bs)
    need = batch * per_seq
    num_blocks = num_blocks or first_block + need
    shape = (num_blocks, bs, kv_heads, head_dim)
    k = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    v = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    used = slice(first_block, first_block + need)
    k[used] = torch.randn((need, bs, kv_heads, head_dim), generator=g).to(device, torch.bfloat16)
    v[used] = torch.randn((need, bs, kv_heads, head_dim), generator=g).to(device, torch.bfloat16)
    perm = torch.randperm(need, generator=g) + first_block
    tables = perm.view(batch, per_seq).to(torch.int32).to(device)
    return k, v, tables


def decode_bandwidth(ctx: dict) -> dict:
    """Decode attention at large batch x context: achieved HBM bandwidth vs the peak."""
    from pdserve.kernels import reference
    from pdserve.kernels.triton_attention import decode_attention, default_num_splits

    cuda, dev = ctx["cuda"], ctx["device"]
    if cuda:
        batch, context, heads, kv_heads, d, bs = 64, 4096, 32, 8, 128, 16
        sweep = [(None, 64, 4, 2)] + [(s, n, w, st) for s in (1, 2, 4, 8) for n in (32, 64, 128)
                                      for w, st in ((4, 2), (8, 2))]  # fmt: skip
    else:
        batch, context, heads, kv_heads, d, bs = 2, 40, 8, 1, 64, 16
        sweep = [(None, 64, 4, 2), (2, 16, 4, 3)]
    k, v, tables = _paged(batch, context, kv_heads, d, bs, dev)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, heads, d, device=dev).to(torch.bfloat16)
    scale = d**-0.5
    nbytes = 2 * batch * context * kv_heads * d * 2 + 2 * q.numel() * 2 + tables.numel() * 4
    expected = reference.paged_decode_attention(q, k, v, tables, lens, scale).float()
    peak = ctx["peak_tbps"]
    configs, failed = [], False
    for splits, block_n, warps, stages in sweep:
        kw = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
        fn = lambda kw=kw: decode_attention(q, k, v, tables, lens, scale, **kw)  # noqa: E731
        err = (fn().float() - expected).abs().max().item()
        failed |= err > 2e-2
        ms = time_ms(fn, cuda)
        tbps = nbytes / (ms * 1e-3) / 1e12
        configs.append(kw | {"max_abs_err": err, "ms": round(ms, 4), "tbps": round(tbps, 3),
                             "pct_peak": round(100 * tbps / peak, 1)})  # fmt: skip
    ref_ms = time_ms(lambda: reference.paged_decode_attention(q, k, v, tables, lens, scale), cuda)
    best = min(configs, key=lambda c: c["ms"])
    return {
        "failed": failed,
        "shape": dict(batch=batch, context=context, heads=heads, kv_heads=kv_heads,
                      head_dim=d, block_size=bs, dtype="bfloat16"),
        "bytes": nbytes, "peak_tbps": peak,
        "default_num_splits": default_num_splits(batch, kv_heads, tables.shape[1] * bs),
        "triton_default": configs[0], "triton_best": best, "sweep": configs,
        "torch_reference_ms": round(ref_ms, 4),
        "goal_pct_peak": GOAL_PCT_PEAK,
        "default_meets_goal": configs[0]["pct_peak"] >= GOAL_PCT_PEAK,
    }  # fmt: skip


def prefill_timing(ctx: dict) -> dict:
    """Prefill attention over a cached prefix plus a chunk: time, TFLOP/s, error."""
    from pdserve.kernels import reference
    from pdserve.kernels.triton_ops import paged_prefill_attention

    cuda, dev = ctx["cuda"], ctx["device"]
    if cuda:
        seqs, prefix, chunk, heads, kv_heads, d, bs = 4, 2048, 2048, 32, 8, 128, 16
    else:
        seqs, prefix, chunk, heads, kv_heads, d, bs = 2, 20, 12, 4, 2, 16, 4
    ctx_len = prefix + chunk
    k, v, tables = _paged(seqs, ctx_len, kv_heads, d, bs, dev)
    q = torch.randn(seqs * chunk, heads, d, device=dev).to(torch.bfloat16)
    qsl = torch.arange(0, (seqs + 1) * chunk, chunk, dtype=torch.int32, device=dev)
    lens = torch.full((seqs,), ctx_len, dtype=torch.int32, device=dev)
    scale = d**-0.5
    args = (q, k, v, tables, qsl, lens, scale)
    err = paged_prefill_attention(*args).float() - reference.paged_prefill_attention(*args).float()
    ms = time_ms(lambda: paged_prefill_attention(*args), cuda)
    ref_ms = time_ms(lambda: reference.paged_prefill_attention(*args), cuda)
    # causal: each query row sees prefix + its position in the chunk (QK^T and PV: 4 flops)
    keys = seqs * (chunk * prefix + chunk * (chunk + 1) / 2)
    flops = 4 * keys * heads * d
    return {
        "failed": err.abs().max().item() > 2e-2,
        "shape": dict(seqs=seqs, prefix=prefix, chunk=chunk, heads=heads, kv_heads=kv_heads,
                      head_dim=d, block_size=bs, dtype="bfloat16"),
        "max_abs_err": err.abs().max().item(), "ms": round(ms, 4),
        "tflops": round(flops / (ms * 1e-3) / 1e12, 1), "torch_reference_ms": round(ref_ms, 4),
    }  # fmt: skip


def huge_cache(ctx: dict) -> dict:
    """More than 2^31 elements per cache plane, block ids near the top: every attention
    path and the KV store still address the right memory (64-bit offsets)."""
    if not ctx["cuda"]:
        raise Skip("dry run: needs 8 GiB of device memory (2 planes of 2^31 bf16 elements)")
    from pdserve.kernels import reference
    from pdserve.kernels import triton_ops as tri

    bs, kv_heads, d, heads = 16, 8, 128, 32
    num_blocks = 2**31 // (bs * kv_heads * d) + 64  # just past 2^31 elements per plane
    batch, context = 4, 300
    per_seq = -(-context // bs)
    top = num_blocks - batch * per_seq  # the tables use the highest block ids
    k, v, tables = _paged(batch, context, kv_heads, d, bs, "cuda", first_block=top,
                          num_blocks=num_blocks)  # fmt: skip
    result: dict = {"elements_per_plane": k.numel(), "lowest_block_used": top}
    scale = d**-0.5
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, d, device="cuda").to(torch.bfloat16)
    errs = {}
    got = tri.paged_decode_attention(q, k, v, tables, lens, scale)
    errs["decode"] = (got.float() - reference.paged_decode_attention(q, k, v, tables, lens,
                                                                     scale).float()).abs().max()  # fmt: skip
    chunk = 64
    qp = torch.randn(batch * chunk, heads, d, device="cuda").to(torch.bfloat16)
    qsl = torch.arange(0, (batch + 1) * chunk, chunk, dtype=torch.int32, device="cuda")
    pargs = (qp, k, v, tables, qsl, lens, scale)
    errs["prefill"] = (tri.paged_prefill_attention(*pargs).float()
                       - reference.paged_prefill_attention(*pargs).float()).abs().max()  # fmt: skip
    # store_kv into the last slots of the cache, then read them back
    t = 32
    slots = torch.arange(num_blocks * bs - t, num_blocks * bs, device="cuda", dtype=torch.int64)
    key = torch.randn(t, kv_heads, d, device="cuda").to(torch.bfloat16)
    val = torch.randn(t, kv_heads, d, device="cuda").to(torch.bfloat16)
    tri.store_kv(key, val, k, v, slots)
    flat_k, flat_v = k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
    result["store_kv_exact"] = bool(
        torch.equal(flat_k[slots], key) and torch.equal(flat_v[slots], val)
    )
    result["max_abs_err"] = {name: e.item() for name, e in errs.items()}
    result["failed"] = not result["store_kv_exact"] or any(e.item() > 2e-2 for e in errs.values())
    del k, v
    torch.cuda.empty_cache()
    return result

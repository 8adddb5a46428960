"""CPU prefill attention (kernels/prefill_attention.py) equals the pure-torch reference, on the
native kernel (kernels/csrc/prefill_attention.cpp) and on torch's flash SDPA
(PDSERVE_PREFILL_ATTENTION=sdpa); fresh prompts read their own K/V (no gather from the
cache), in one native call, or one flash call per batch of equal prompts.

Each case stores the step's K/V into a paged cache first (as the model does), then runs
both with the same arguments. Tolerances as tests/test_paged_decode.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import profile

from pdserve.kernels import prefill_attention
from pdserve.kernels import reference as ref
from tests.conftest import skip_in_isa_view

pytestmark = pytest.mark.isa  # scripts/avx2_view.sh runs it as an AVX2-only CPU

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


def make_step(chunks, h, hkv, d, bs, dtype, seed=0):
    """chunks: (cached prefix, new tokens) per sequence. Returns the prefill arguments and
    this step's (k, v), with q and k/v strided views of one qkv tensor, as in the model."""
    g = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in chunks]
    need = [(n + bs - 1) // bs for n in lens]
    n_blocks = sum(need) + 3
    k_cache = torch.randn((n_blocks, bs, hkv, d), generator=g).to(dtype)
    v_cache = torch.randn((n_blocks, bs, hkv, d), generator=g).to(dtype)
    perm = torch.randperm(n_blocks - 1, generator=g) + 1
    table = torch.zeros((len(chunks), max(need) + 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used : used + n]
        used += n
    t = sum(n for _, n in chunks)
    qkv = torch.randn((t, (h + 2 * hkv) * d), generator=g).to(dtype)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)
    slots = []
    for i, (p, n) in enumerate(chunks):
        pos = torch.arange(p, p + n)
        slots.append(table[i].long()[pos // bs] * bs + pos % bs)
    ref.store_kv(k, v, k_cache, v_cache, torch.cat(slots))
    starts = torch.tensor([0] + [n for _, n in chunks]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return (q, k_cache, v_cache, table, starts, seq_lens, d**-0.5), (k, v)


CASES = [  # (chunks, H, Hkv, D, block_size)
    ([(0, 128)] * 8, 9, 3, 64, 16),  # equal fresh prompts: one batched call
    ([(0, 20), (0, 1), (0, 77)], 9, 3, 64, 16),  # fresh, varied lengths
    ([(0, 20), (33, 17), (16, 1), (5, 0), (200, 70)], 6, 2, 64, 16),  # prefixes + empty
    ([(0, 40), (40, 40)], 4, 4, 32, 4),  # MHA: a fresh chunk and the next chunk
    ([(3, 9), (0, 30)], 8, 1, 128, 32),  # MQA, head dim 128
    ([(0, 300), (0, 129), (10, 5)], 4, 2, 80, 16),  # several 128-row blocks, head dim 80
]
PATHS = ["native", "sdpa"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv(prefill_attention.PREFILL_ATTENTION_ENV, request.param)
    if request.param == "native":
        assert prefill_attention.available()  # the box has a compiler: the kernel must build
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks,h,hkv,d,bs", CASES)
def test_prefill_equals_reference(chunks, h, hkv, d, bs, dtype, path):
    args, new_kv = make_step(chunks, h, hkv, d, bs, dtype)
    expected = ref.paged_prefill_attention(*args)
    for kv in (new_kv, None):  # this step's K/V given, or read back from the cache
        actual = prefill_attention.paged_prefill_attention(*args, new_kv=kv)
        assert actual.dtype == dtype and actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, **TOL[dtype])


_OTHER_BUILD = """
import os, torch
from pdserve.kernels import prefill_attention
from pdserve.kernels import reference as ref
from tests.test_prefill_attention import CASES, TOL, make_step
assert prefill_attention.available()
torch.set_num_threads(2)
for dtype in (torch.float32, torch.bfloat16):
    for chunks, h, hkv, d, bs in CASES:
        args, new_kv = make_step(chunks, h, hkv, d, bs, dtype)
        expected = ref.paged_prefill_attention(*args)
        actual = prefill_attention.paged_prefill_attention(*args, new_kv=new_kv)
        torch.testing.assert_close(actual, expected, **TOL[dtype])
print("ok")
"""


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


@pytest.mark.parametrize(
    "march", ["haswell", "x86-64", "skylake-avx512"], ids=["avx2", "scalar", "avx512-no-bf16"]
)
def test_native_kernel_other_vector_paths(march, tmp_path):
    """The CI box kind (AVX2, no AVX-512 nor avx512_bf16: fp32 arithmetic for bf16 too, the
    generic softmax), the plain C++ build, and AVX-512 without avx512_bf16 (the AVX-512
    softmax, fp32 dot products) equal the reference as well."""
    skip_in_isa_view()
    if not os.uname().machine.startswith("x86"):
        pytest.skip("x86 -march values")
    if march == "skylake-avx512" and not _cpu_has("avx512bw"):
        pytest.skip("this CPU cannot run an AVX-512 build")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PDSERVE_KERNEL_MARCH=march, PYTHONPATH=str(root))
    env["PDSERVE_KERNEL_CACHE"] = str(tmp_path)
    env[prefill_attention.PREFILL_ATTENTION_ENV] = "native"
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_BUILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _ops(fn) -> dict[str, int]:
    with profile() as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


def test_fresh_prompts_skip_the_cache_and_run_flash(monkeypatch):
    monkeypatch.setenv(prefill_attention.PREFILL_ATTENTION_ENV, "sdpa")
    args, new_kv = make_step([(0, 64)] * 4, 9, 3, 64, 16, torch.float32)
    ops = _ops(lambda: prefill_attention.paged_prefill_attention(*args, new_kv=new_kv))
    assert ops.get(FLASH) == 1  # one call for the batch of equal prompts
    assert "aten::index" not in ops  # no gather of K/V out of the cache
    args, new_kv = make_step([(0, 64), (0, 30), (16, 8)], 9, 3, 64, 16, torch.float32)
    ops = _ops(lambda: prefill_attention.paged_prefill_attention(*args, new_kv=new_kv))
    assert ops.get(FLASH) == 3
    assert ops.get("aten::index") == 2  # K and V of the one sequence with a prefix
    assert "aten::_scaled_dot_product_attention_math" not in ops


def test_native_runs_every_sequence_without_torch_attention():
    """Fresh prompts of any lengths: no torch attention op and no gather; a sequence with
    a cached prefix beside them goes to the native kernel too (its context gathered)."""
    args, new_kv = make_step([(0, 64), (0, 7), (0, 130)], 9, 3, 64, 16, torch.float32)
    ops = _ops(lambda: prefill_attention.paged_prefill_attention(*args, new_kv=new_kv))
    assert FLASH not in ops and "aten::index" not in ops
    args, new_kv = make_step([(0, 64), (32, 8), (0, 5)], 9, 3, 64, 16, torch.float32)
    ops = _ops(lambda: prefill_attention.paged_prefill_attention(*args, new_kv=new_kv))
    assert FLASH not in ops
    assert ops.get("aten::index") == 2  # K and V of the sequence with a prefix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [1, 16, 32, 129, 200])
def test_a_prompt_gets_the_same_bits_with_its_prefix_cached(dtype, prefix):
    """The same prompt computed fresh, and again with its first `prefix` tokens cached
    (only the rest in the step, beside other sequences): the recomputed rows are bitwise
    equal. (Otherwise the same request twice gives different logprobs.)"""
    h, hkv, d, bs, n = 9, 3, 64, 16, 260
    args, new_kv = make_step([(0, n)], h, hkv, d, bs, dtype, seed=1)
    q, k_cache, v_cache, table, _, _, scale = args
    fresh = prefill_attention.paged_prefill_attention(*args, new_kv=new_kv)
    # the second step: a fresh neighbour, then the same prompt's rows prefix .. n
    other, other_kv = make_step([(0, 37)], h, hkv, d, bs, dtype, seed=2)
    t = 37 + n - prefix
    q2 = torch.cat([other[0], q[prefix:]])
    k2 = torch.cat([other_kv[0], new_kv[0][prefix:]])
    v2 = torch.cat([other_kv[1], new_kv[1][prefix:]])
    kc = torch.cat([k_cache, other[1]])  # the neighbour's blocks after the prompt's
    vc = torch.cat([v_cache, other[2]])
    tables = torch.zeros((2, max(table.shape[1], other[3].shape[1])), dtype=torch.int32)
    tables[0, : other[3].shape[1]] = other[3][0] + k_cache.shape[0]
    tables[1, : table.shape[1]] = table[0]
    starts = torch.tensor([0, 37, t], dtype=torch.int32)
    lens = torch.tensor([37, n], dtype=torch.int32)
    cached = prefill_attention.paged_prefill_attention(
        q2, kc, vc, tables, starts, lens, scale, new_kv=(k2, v2)
    )
    assert torch.equal(cached[37:], fresh[prefix:])
    torch.testing.assert_close(cached[:37], prefill_attention.paged_prefill_attention(
        *other, new_kv=other_kv), rtol=0, atol=0)  # fmt: skip


def test_the_reference_stays_the_unfused_oracle():
    """PDSERVE_CPU_ATTENTION=reference keeps the gather + math SDPA (what prefill_attention is
    checked against), not the flash kernel."""
    args, _ = make_step([(0, 16)] * 2, 4, 2, 32, 16, torch.float32)
    ops = _ops(lambda: ref.paged_prefill_attention(*args))
    assert "aten::_scaled_dot_product_attention_math" in ops and FLASH not in ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_table_short_of_its_context_is_refused(dtype, path):
    """A sequence with a cached prefix whose block table holds fewer blocks than its
    context length needs: the gathered context is short, and the native kernel (which
    reads seq_len keys) must not read past it; both paths raise instead."""
    args, new_kv = make_step([(0, 20), (40, 8)], 4, 2, 32, 16, dtype)
    q, k_cache, v_cache, table, starts, seq_lens, scale = args
    table = table[:, :2].contiguous()  # the second sequence needs 3 blocks for 48 keys
    with pytest.raises((RuntimeError, IndexError, ValueError)):
        prefill_attention.paged_prefill_attention(
            q, k_cache, v_cache, table, starts, seq_lens, scale, new_kv=new_kv
        )

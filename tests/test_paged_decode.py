"""The native CPU paged decode attention (kernels/csrc/paged_decode.cpp) equals the
pure-torch reference on random paged caches, and every way it cannot run falls back to it.

Tolerances: fp32 atol 1e-5 / rtol 1e-4; bf16 atol 2e-2 / rtol 2e-2 (both accumulate in
fp32, they round the output once; the reference's SDPA may round intermediate products).
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

from pdserve.kernels import cpu_ops, native, paged_decode
from pdserve.kernels import reference as ref
from pdserve.kernels.ops import CPU_ATTENTION_ENV, get_ops

pytestmark = pytest.mark.isa  # scripts/avx2_view.sh runs it as an AVX2-only CPU

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
SCALE = 0.125


@pytest.fixture(scope="module", autouse=True)
def built():
    if native.find_compiler() is None:
        pytest.skip("no C++ compiler on this machine: the kernel falls back (tested below)")
    assert paged_decode.available()


def make_case(lens, h, hkv, d, bs, dtype, seed=0, strided_q=False):
    """Random caches with spare blocks, shuffled tables padded with block 0 (and an extra
    padding column), and q optionally a strided view (as the model's qkv split gives)."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + bs - 1) // bs for n in lens]
    n_blocks = sum(need) + 3
    k_cache = torch.randn((n_blocks, bs, hkv, d), generator=g).to(dtype)
    v_cache = torch.randn((n_blocks, bs, hkv, d), generator=g).to(dtype)
    perm = torch.randperm(n_blocks - 1, generator=g) + 1
    table = torch.zeros((len(lens), max(need) + 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used : used + n]
        used += n
    if strided_q:  # [B, (H + 2 Hkv) * D] split like the model's qkv projection
        qkv = torch.randn((len(lens), (h + 2 * hkv) * d), generator=g).to(dtype)
        q = qkv[:, : h * d].view(len(lens), h, d)
        assert not q.is_contiguous()
    else:
        q = torch.randn((len(lens), h, d), generator=g).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


CASES = [  # (context lengths, H, Hkv, D, block_size)
    ([1], 9, 3, 64, 16),
    ([150] * 32, 9, 3, 64, 16),  # the SmolLM2 decode shape
    ([1, 16, 17, 33, 5, 300], 9, 3, 64, 16),  # not multiples of the block size
    ([2500], 9, 3, 64, 16),  # long context, one sequence: split into key ranges
    ([2049, 7], 8, 2, 128, 32),
    ([40] * 64 + [900], 4, 4, 32, 4),  # MHA, 65 sequences
    ([3, 1000, 64], 6, 1, 16, 8),  # MQA
    ([33, 70, 18], 4, 2, 80, 16),  # head dim 80: an odd number of 16-lane vectors
    ([20, 300], 2, 1, 256, 8),  # head dim 256: one head's accumulators fill the registers
    ([45, 130], 7, 1, 64, 16),  # 7 query heads a kv head: V passes of 4 and 3 heads
    ([60], 5, 1, 80, 16),  # head dim 80: passes of 3 and 2 heads
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,h,hkv,d,bs", CASES)
def test_native_decode_equals_reference(lens, h, hkv, d, bs, dtype):
    args = make_case(lens, h, hkv, d, bs, dtype, strided_q=len(lens) % 2 == 0)
    expected = ref.paged_decode_attention(*args, SCALE)
    actual = paged_decode.paged_decode_attention(*args, SCALE)
    assert actual.dtype == dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_count_and_key_splits_do_not_change_the_result(threads, monkeypatch):
    args = make_case([1800, 3, 700], 9, 3, 64, 16, torch.float32, seed=1)
    expected = ref.paged_decode_attention(*args, SCALE)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for splits in (1, 2, 7, 20):
            monkeypatch.setattr(paged_decode, "num_splits", lambda *_, s=splits: s)
            actual = paged_decode.paged_decode_attention(*args, SCALE)
            torch.testing.assert_close(actual, expected, **TOL[torch.float32])
    finally:
        torch.set_num_threads(before)


def test_num_splits_keeps_threads_busy_only_when_needed():
    assert paged_decode.num_splits(32, 150, 2) == 1  # 32 sequences: enough work items
    assert paged_decode.num_splits(1, 2000, 2) == 8  # 1 long sequence: 8 work items
    assert paged_decode.num_splits(3, 2000, 2) == 3  # 3 sequences: 9 work items
    assert paged_decode.num_splits(1, 200, 2) == 1  # too short to split


def test_unsupported_inputs_use_the_reference():
    q, k, v, table, lens = make_case([20, 5], 4, 2, 16, 4, torch.float16)
    assert not paged_decode.supports(q, k, v)
    torch.testing.assert_close(
        paged_decode.paged_decode_attention(q, k, v, table, lens, SCALE),
        ref.paged_decode_attention(q, k, v, table, lens, SCALE),
    )
    q32, k32, v32, _, _ = make_case([20, 5], 4, 2, 16, 4, torch.float32)
    strided_cache = torch.cat([k32, k32], dim=-1)[..., :16]
    assert not paged_decode.supports(q32, strided_cache, v32)
    for d in (8, 72, 144):  # head dims the kernel is not built for
        q, k, v, table, lens = make_case([20, 5], 4, 2, d, 4, torch.bfloat16)
        assert not paged_decode.supports(q, k, v)
        torch.testing.assert_close(
            paged_decode.paged_decode_attention(q, k, v, table, lens, SCALE),
            ref.paged_decode_attention(q, k, v, table, lens, SCALE),
        )


def test_no_compiler_falls_back_to_the_reference_with_a_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ / c++ / clang++ here
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    native.load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.kernels.native"):
            assert not paged_decode.available()
        assert "no C++ compiler" in caplog.text and "pure-torch reference" in caplog.text
        args = make_case([37, 5], 9, 3, 64, 16, torch.float32)
        torch.testing.assert_close(
            paged_decode.paged_decode_attention(*args, SCALE),
            ref.paged_decode_attention(*args, SCALE),
            rtol=0,
            atol=0,
        )
    finally:
        native.load_library.cache_clear()


def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    path = native.build("paged_decode")
    assert path.parent == tmp_path and path.exists()
    mtime = path.stat().st_mtime_ns
    assert native.build("paged_decode") == path and path.stat().st_mtime_ns == mtime
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags: another cpu")
    assert native.library_path("paged_decode", native.find_compiler()) != path


def test_get_ops_torch_selects_native_unless_reference_is_asked_for(monkeypatch):
    monkeypatch.delenv(CPU_ATTENTION_ENV, raising=False)
    assert get_ops("torch") is cpu_ops
    for name, fn in inspect.getmembers(ref, inspect.isfunction):
        if not name.startswith("_") and fn.__module__ == ref.__name__:
            assert inspect.signature(getattr(cpu_ops, name)) == inspect.signature(fn)
    monkeypatch.setenv(CPU_ATTENTION_ENV, "reference")
    assert get_ops("torch") is ref
    monkeypatch.setenv(CPU_ATTENTION_ENV, "fast")
    with pytest.raises(ValueError, match=CPU_ATTENTION_ENV):
        get_ops("torch")


@pytest.mark.parametrize("mode", ["native", "reference"])
def test_engine_greedy_equals_hugging_face_with_either_kernel(mode, tiny_llama_dir, monkeypatch):
    from pdserve.engine import LLM, SamplingParams
    from tests.hf_reference import hf_greedy, load_hf

    monkeypatch.setenv(CPU_ATTENTION_ENV, mode)
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=256)
    attn = llm.engine.runner.model.model.layers[0].self_attn.attn
    assert attn.ops is (cpu_ops if mode == "native" else ref)
    hf = load_hf(tiny_llama_dir)
    prompts = [[(7 * i + 3 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate([1, 5, 37])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for p, out in zip(prompts, llm.generate(prompts, params)):
        assert out.token_ids == hf_greedy(hf, p, 12), f"prompt len {len(p)}"

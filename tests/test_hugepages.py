"""kernels/hugepages.py: large CPU buffers asked for on 2 MiB pages, usable like torch.empty."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.kernels import hugepages

pytestmark = pytest.mark.usefixtures("huge_pages")  # conftest turns them off elsewhere


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_on_here_where_the_kernel_offers_them():
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if os.uname().sysname == "Linux" and os.path.exists(thp):
        assert hugepages.available() == ("[never]" not in open(thp).read())


def test_empty_is_a_usable_tensor(monkeypatch):
    t = hugepages.empty((3, 1 << 20), torch.float32)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert not hugepages.zeros((3, 1 << 20), torch.float32).any()  # a fresh mapping
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * 3 * (1 << 20)
    if hugepages.available():  # the span starts on a 2 MiB boundary
        assert t.data_ptr() % hugepages.HUGE == 0
    small = hugepages.empty((5,), torch.bfloat16)  # under 2 MiB: a plain tensor
    assert small.shape == (5,) and small.dtype == torch.bfloat16


def test_switched_off(monkeypatch):
    monkeypatch.setenv("PDSERVE_HUGEPAGES", "0")
    hugepages.available.cache_clear()
    try:
        assert not hugepages.available()
        t = hugepages.empty((1 << 21,), torch.float32)
        assert t.numel() == 1 << 21 and t.untyped_storage().nbytes() == 4 << 21
        assert not hugepages.zeros((3, 1 << 20), torch.float32).any()
        # still a fresh mapping: a 256 MiB KV cache costs no memory until it is written
        before = _rss()
        kv = hugepages.zeros((256 << 20,), torch.uint8)
        assert _rss() - before < 16 << 20
        kv[: 32 << 20].fill_(1)  # the pages written, and only those, become resident
        assert 32 << 20 <= _rss() - before < 48 << 20
        assert int(kv[32 << 20 :].sum()) == 0
    finally:
        monkeypatch.delenv("PDSERVE_HUGEPAGES")
        hugepages.available.cache_clear()


def test_kv_cache_is_zeroed_on_huge_pages():
    from pdserve.engine.kv_tensor import allocate_kv_cache

    for layout in ("layer_major", "block_major"):
        kv = allocate_kv_cache(layout, 2, 64, 16, 2, 64, dtype=torch.float32, device="cpu")
        assert kv.shape == (2, 2, 64, 16, 2, 64) and not kv.any()


def test_model_weights_moved_keep_their_values(tiny_llama_dir):
    from pdserve.engine import LLM

    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=64)
    model = llm.engine.runner.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    big = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB: moved
    w = big.weight.detach().clone()
    moved = hugepages.move_parameters(big)
    assert torch.equal(big.weight, w)
    if hugepages.available():
        assert moved == 1 and big.weight.data_ptr() % hugepages.HUGE == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_packed_decode_weights_are_on_huge_pages():
    from pdserve.kernels import gemm_packed

    if not gemm_packed.available():
        pytest.skip("no native gemm_packed library here")
    w = torch.randn(1024, 1024)
    packed = gemm_packed.Packed(w)
    x = torch.randn(3, 1024)
    torch.testing.assert_close(packed.gemm(x), x @ w.T, rtol=1e-4, atol=1e-4)
    if hugepages.available():
        assert packed.ptr() % hugepages.HUGE == 0


def test_memory_outlives_the_mapping_object_and_is_huge():
    import gc

    t = hugepages.empty((64 << 20,), torch.uint8)
    gc.collect()  # only the tensor refers to the mapping now
    t.fill_(7)
    assert int(t[::4096].sum()) == 7 * (t.numel() // 4096)
    if hugepages.available():
        with open("/proc/self/smaps_rollup") as f:
            huge_kb = next(int(x.split()[1]) for x in f if x.startswith("AnonHugePages"))
        assert huge_kb > 0  # the kernel may refuse some (fragmentation), not every one


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) pages under t's elements (t: contiguous, or a permuted view of a
    contiguous tensor), by mincore(2)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE  # the tensor's own bytes (its storage may hold alignment slack)
    start = t.data_ptr() - t.data_ptr() % page
    length = (t.data_ptr() + t.numel() * t.element_size() - start + page - 1) // page * page
    pages = length // page
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw), pages


def test_populate_faults_every_page_in_and_keeps_the_zeros():
    t = hugepages.zeros((16 << 20,), torch.uint8)  # 16 MiB: a fresh mapping where THP is on
    before, pages = _resident_pages(t)
    ok = hugepages.populate(t)
    if os.uname().sysname != "Linux" or not ok:  # a kernel before 5.14: nothing happened
        assert _resident_pages(t)[0] == before
        return
    assert _resident_pages(t) == (pages, pages)
    if hugepages.available():
        assert before < pages  # it was not resident before: populate did it
    assert not t.any()  # still zeros
    t[::4096] = 7  # and writable
    assert int(t.sum()) == 7 * (16 << 20) // 4096
    assert not hugepages.populate(torch.empty(0))  # nothing to do


def test_engine_populates_its_kv_cache_unless_told_not_to(tiny_llama_dir, monkeypatch):
    from pdserve.engine import LLM, SamplingParams

    monkeypatch.delenv("PDSERVE_KV_POPULATE")  # conftest turns it off for the other tests
    kw = dict(block_size=4, num_blocks=4096)  # 4096 blocks: several MiB of KV
    outs = {}
    for populate in (True, False):
        llm = LLM(tiny_llama_dir, kv_populate=populate, **kw)
        kv, fault = llm.engine.runner.kv_cache, llm.engine.runner.kv_fault
        if populate and fault is not None:  # faulting in on a thread (kernels/fault_in.py)
            assert fault.wait(60) and fault.error is None and fault.seconds is not None
        resident, pages = _resident_pages(kv)
        if populate:
            assert resident == pages
        elif hugepages.available():
            assert resident < pages  # faulted in lazily, on first use
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        outs[populate] = llm.generate([[1, 2, 3, 4, 5]], params)[0].token_ids
    assert outs[True] == outs[False] and len(outs[True]) == 8
    monkeypatch.setenv("PDSERVE_KV_POPULATE", "0")
    llm = LLM(tiny_llama_dir, kv_populate=True, **kw)  # the switch wins over the config
    if hugepages.available():
        assert _resident_pages(llm.engine.runner.kv_cache)[0] < _resident_pages(kv)[1]


def test_kv_populate_from_the_command_line_and_the_cluster_file(tmp_path):
    """`--no-kv-populate` and YAML `kv_populate: false` reach CacheConfig.kv_populate."""
    from tests.test_cluster_config import GOOD, node_engine_config, write

    def populate(argv: list[str]) -> bool:
        return node_engine_config(argv).cache.kv_populate

    assert populate([]) is True and populate(["--no-kv-populate"]) is False
    path = write(tmp_path, GOOD)
    assert populate(["--config", str(path), "--node", "decode-0"]) is True
    argv = ["--config", str(path), "--node", "decode-0", "--set", "decode.kv_populate=false"]
    assert populate(argv) is False

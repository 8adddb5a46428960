"""The compiled decode step (engine/compiled_model.py): token-for-token equal to Hugging Face
greedy, like the eager reference; one graph per batch bucket, never recompiled while
serving; padded rows never change the real rows' outputs or the KV cache."""

import pytest
import torch

from pdserve.common.model_files import default_cache_dir
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.compiled_model import CompiledDecode, compiled_graph_count, decode_buckets
from pdserve.engine.config import ModelConfig
from tests.hf_reference import hf_greedy, load_hf
from tests.test_engine import random_prompts

MAX_SEQS = 8  # buckets 1, 2, 4, 8


@pytest.fixture(scope="module")
def compiled_llm(tiny_llama_dir):
    # A module-scoped engine: the compile (one graph per bucket, C++ builds) is paid once
    # here, or loaded from the on-disk cache (<pdserve cache dir>/compile) when warm.
    llm = LLM(
        tiny_llama_dir, block_size=4, num_blocks=512, max_num_seqs=MAX_SEQS, enforce_eager=False
    )
    assert isinstance(llm.engine.runner.model.compiled_decode, CompiledDecode)
    cache = default_cache_dir() / "compile"
    assert cache.is_dir() and any(cache.rglob("*.py")), "no compiled code cached on disk"
    return llm


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def test_compiled_step_equals_hf_greedy(tiny_llama_dir, compiled_llm):
    llm = compiled_llm
    hf = load_hf(tiny_llama_dir)
    graphs = compiled_graph_count()
    # one lone decode row, then batches of 3, 5 and 9 (> MAX_SEQS) rows of very
    # different lengths: every bucket, padded rows in most steps, a chunked prompt
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for prompts in (
        random_prompts(1, [7]),
        random_prompts(3, [4, 30, 9], seed=2),
        random_prompts(5, [1, 3, 64, 17, 130], seed=3),
        random_prompts(9, [1, 3, 4, 5, 17, 64, 130, 2, 33], seed=1),
    ):
        outs = llm.generate(prompts, params)
        for p, o in zip(prompts, outs):
            assert o.token_ids == hf_greedy(hf, p, 10), f"prompt len {len(p)}"
    llm.engine.check_integrity()
    assert compiled_graph_count() == graphs, "serving recompiled after warm-up"


def test_compiled_logits_match_eager(tiny_llama_dir, compiled_llm):
    llm = compiled_llm
    eager = LLM(tiny_llama_dir, block_size=4, num_blocks=512, enforce_eager=True)
    assert eager.engine.runner.model.compiled_decode is None
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    prompts = random_prompts(3, [5, 40, 12], seed=5)
    for a, b in zip(llm.generate(prompts, params), eager.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4
        )


def _decode_inputs(rows: int, kv_cache: torch.Tensor, seed: int):
    """`rows` decode rows over random, disjoint blocks of a random cache; each row stores
    its new token's K/V in a fresh slot."""
    g = torch.Generator().manual_seed(seed)
    bs, nblocks = kv_cache.shape[3], kv_cache.shape[2]
    lens = torch.randint(1, 6 * bs, (rows,), generator=g, dtype=torch.int32)
    width = int(-(-lens.max() // bs))
    perm = torch.randperm(nblocks, generator=g)[: rows * width].to(torch.int32)
    tables = perm.reshape(rows, width)
    pos = (lens - 1).long()
    slots = tables[torch.arange(rows), pos // bs].long() * bs + pos % bs
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=rows,
        decode_block_tables=tables,
        decode_context_lens=lens,
        prefill_block_tables=tables[:0],
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens=lens[:0],
    )
    ids = torch.randint(0, 1000, (rows,), generator=g)
    return ids, pos, meta


def test_padded_rows_do_not_change_outputs(compiled_llm):
    runner = compiled_llm.engine.runner
    model, compiled = runner.model, runner.model.compiled_decode
    graphs = compiled_graph_count()
    cache = torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(0))
    ids, pos, meta = _decode_inputs(4, cache, seed=1)
    # 3 real rows padded to bucket 4, against the same 3 rows beside a real 4th row
    three = AttentionMetadata(
        meta.slot_mapping[:3], 3, meta.decode_block_tables[:3], meta.decode_context_lens[:3],
        meta.prefill_block_tables, meta.prefill_query_start_loc, meta.prefill_seq_lens,
    )  # fmt: skip
    kv_padded, kv_full, kv_eager = cache.clone(), cache.clone(), cache.clone()
    with torch.inference_mode():
        padded = compiled(ids[:3], pos[:3], kv_padded, three)
        full = compiled(ids, pos, kv_full, meta)
        model.compiled_decode = None
        try:
            eager = model(ids[:3], pos[:3], kv_eager, three)
        finally:
            model.compiled_decode = compiled
    assert padded.shape == (3, model.config.hidden_size)
    assert torch.equal(padded, full[:3]), "a padded row changed a real row's output"
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    # the real rows' K/V stored (same as eager), the padded row stored nothing
    written = kv_padded != cache
    assert written.any() and torch.equal(written, kv_eager != cache)
    torch.testing.assert_close(kv_padded, kv_eager, rtol=1e-5, atol=1e-5)
    assert compiled_graph_count() == graphs, "a batch size recompiled"


def test_steps_outside_the_buckets_run_eager(compiled_llm):
    compiled = compiled_llm.engine.runner.model.compiled_decode
    cache = torch.zeros(compiled_llm.engine.runner.kv_cache.shape)
    ids, pos, meta = _decode_inputs(MAX_SEQS + 1, cache, seed=2)
    assert compiled(ids, pos, cache, meta) is None  # more rows than the largest bucket
    ids, pos, meta = _decode_inputs(2, cache, seed=3)
    meta.prefill_seq_lens = torch.tensor([3], dtype=torch.int32)  # a prompt chunk in it
    assert compiled(ids, pos, cache, meta) is None


def test_enforce_eager_default_is_eager():
    assert not ModelConfig().compiled  # measured as fast or faster (docs/benchmarks.md)
    assert ModelConfig(enforce_eager=False).compiled
    assert ModelConfig(dtype="bfloat16", enforce_eager=False).compiled
    assert not ModelConfig(enforce_eager=True).compiled
    assert not ModelConfig(device="cuda", enforce_eager=False).compiled  # CUDA: eager

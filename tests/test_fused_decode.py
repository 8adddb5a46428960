"""The fused decode forward (engine/models/fused_decode.py): one native call for a decode
step of <= 8 rows and the per-layer loop without packed weights, equal bit for bit to the
model's per-op path; used by the engine. The batched forward on packed weights for more
rows: tests/test_fused_decode_batched.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.models.fused_decode import FusedDecode
from pdserve.engine.step_plan import ForwardPath, StepPlan, plan_step
from tests.conftest import make_tiny_llama, skip_in_isa_view
from tests.hf_reference import hf_greedy, load_hf
from tests.test_compiled_model import _decode_inputs
from tests.test_engine import random_prompts

pytestmark = pytest.mark.isa  # scripts/avx2_view.sh runs it as an AVX2-only CPU

ROOT = Path(__file__).resolve().parent.parent


def _per_op_and_fused(model, ids, pos, cache, meta):
    """(per-op hidden, per-op cache, fused hidden, fused cache) from the same inputs."""
    fused = model.fused_decode
    kv_ref, kv_fused = cache.clone(), cache.clone()
    steps = _steps(fused)
    with torch.inference_mode():
        model.fused_decode = None
        try:
            ref = model(ids, pos, kv_ref, meta)
        finally:
            model.fused_decode = fused
        got = model(ids, pos, kv_fused, meta)
    assert _steps(fused) == steps + 1, "the fused path did not run"
    return ref, kv_ref, got, kv_fused


def _steps(fused) -> int:
    return fused.steps + fused.layer_steps + fused.batch_steps


def _same_layout_cache(runner, seed: int) -> torch.Tensor:
    cache = runner.kv_cache.clone()  # clone keeps the layout's strides
    g = torch.Generator().manual_seed(seed)
    cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    return cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_fused_equals_per_op(tiny_llama_dir, dtype, layout):
    llm = LLM(
        tiny_llama_dir,
        keep_plain_weights=True,
        dtype=dtype,
        block_size=4,
        num_blocks=256,
        kv_layout=layout,
    )
    runner = llm.engine.runner
    model = runner.model
    assert isinstance(model.fused_decode, FusedDecode)
    model.fused_decode = FusedDecode.build(model, batch=False)  # the batched forward: below
    # <= 8 rows: one call; more: one attention call a layer, the GEMMs oneDNN's
    for rows, threads in [(1, 1), (3, 2), (8, 2), (2, 1), (9, 1), (32, 2)]:
        torch.set_num_threads(threads)
        cache = _same_layout_cache(runner, seed=rows)
        ids, pos, meta = _decode_inputs(rows, cache, seed=rows)
        ref, kv_ref, got, kv_fused = _per_op_and_fused(model, ids, pos, cache, meta)
        assert torch.equal(got, ref), (rows, (got.float() - ref.float()).abs().max())
        assert torch.equal(kv_fused, kv_ref), "the K/V stored differ"
        assert not torch.equal(kv_fused, cache), "nothing was stored"
    torch.set_num_threads(1)


def test_fused_with_qkv_bias_and_long_context(tmp_path):
    """A Qwen2-style qkv bias; contexts long enough for attention key splits."""
    path = make_tiny_llama(str(tmp_path / "m"), seed=3)
    llm = LLM(path, keep_plain_weights=True, block_size=16, num_blocks=256)
    runner = llm.engine.runner
    model = runner.model
    g = torch.Generator().manual_seed(4)
    for layer in model.model.layers:  # the bias Qwen2 checkpoints carry
        proj = layer.self_attn.qkv_proj
        proj.bias = torch.nn.Parameter(torch.randn(proj.out_features, generator=g))
    model.fused_decode = FusedDecode.build(model)
    cache = _same_layout_cache(runner, seed=7)
    g = torch.Generator().manual_seed(1)
    rows, width = 2, 30
    tables = torch.randperm(256, generator=g)[: rows * width].to(torch.int32).reshape(rows, width)
    lens = torch.tensor([470, 301], dtype=torch.int32)
    pos = (lens - 1).long()
    slots = tables[torch.arange(rows), pos // 16].long() * 16 + pos % 16
    meta = AttentionMetadata(
        slots, rows, tables, lens, tables[:0], torch.zeros(1, dtype=torch.int32), lens[:0]
    )
    ids = torch.tensor([5, 900])
    for threads in (1, 2):
        torch.set_num_threads(threads)
        ref, kv_ref, got, kv_fused = _per_op_and_fused(model, ids, pos, cache, meta)
        assert torch.equal(got, ref) and torch.equal(kv_fused, kv_ref)
    torch.set_num_threads(1)


def test_steps_it_does_not_take_run_per_op(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, keep_plain_weights=True, block_size=4, num_blocks=256)
    runner = llm.engine.runner
    model, fused = runner.model, runner.model.fused_decode
    cache = _same_layout_cache(runner, seed=0)
    steps = fused.steps, fused.layer_steps, fused.batch_steps
    with torch.inference_mode():
        for rows in (2, 12):
            ids, pos, meta = _decode_inputs(rows, cache, seed=2)
            bad = ids.clone()
            bad[1] = 1024  # outside the vocabulary: per-op path, which raises as it always has
            with pytest.raises(IndexError):
                model(bad, pos, cache, meta)
            assert fused(ids.int(), pos, cache, meta) is None  # int32 ids: not taken
            bad = pos.clone()
            bad[0] = 10**6  # outside the RoPE table: per-op path
            assert fused(ids, bad, cache, meta) is None
        by_layer = FusedDecode.build(model, batch=False)
        model.model.layers[0].mlp.tile_rows = 8  # the per-op MLP would run in row tiles
        try:
            assert by_layer(ids, pos, cache, meta) is None
        finally:
            model.model.layers[0].mlp.tile_rows = None
    assert (fused.steps, fused.layer_steps, fused.batch_steps) == steps


def test_engine_uses_fused_decode_and_equals_hf(tiny_llama_dir):
    """Greedy tokens equal Hugging Face's, with the decode steps run fused (a test that
    fails if the engine silently stops taking the fused path)."""
    hf = load_hf(tiny_llama_dir)
    llm = LLM(tiny_llama_dir, keep_plain_weights=True, block_size=4, num_blocks=512)
    fused = llm.engine.runner.model.fused_decode
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(3, [5, 40, 17], seed=11)
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, params.max_tokens)
    assert fused.steps >= 11, fused.steps  # every decode step of the three rows
    # more rows than MAX_ROWS: the batched forward (fp32)
    prompts = random_prompts(10, [3, 9, 20], seed=12)
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, params.max_tokens)
    assert fused.batch_steps >= 10, fused.batch_steps
    # and the per-layer path (bf16, or no packed weights)
    llm.engine.runner.model.fused_decode = fused = FusedDecode.build(
        llm.engine.runner.model, batch=False
    )
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, params.max_tokens)
    assert fused.layer_steps >= 10, fused.layer_steps


def test_packing_skipped_where_no_step_can_take_it(tiny_llama_dir):
    """A scheduler of at most MAX_ROWS sequences never runs a batched step: no packed copy."""
    llm = LLM(tiny_llama_dir, keep_plain_weights=True, block_size=4, num_blocks=64, max_num_seqs=8)
    fused = llm.engine.runner.model.fused_decode
    assert fused._batch_fn is None and fused.lm_head is None and not fused._packed


def test_no_fused_decode_with_reference_kernels(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "reference")
    llm = LLM(tiny_llama_dir, keep_plain_weights=True, block_size=4, num_blocks=64)
    assert llm.engine.runner.model.fused_decode is None


_OTHER_BUILD = """
import torch
from pdserve.engine import LLM
from tests.test_fused_decode import _decode_inputs, _per_op_and_fused, _same_layout_cache
from pdserve.kernels import gemv
assert gemv.isa() == 256, gemv.isa()
from tests.test_fused_decode_batched import _batched, _batched_close_to_per_op
from pdserve.engine.models.fused_decode import FusedDecode
from pdserve.engine.step_plan import ForwardPath, StepPlan, plan_step
for dtype in ("float32", "bfloat16"):
    llm = LLM({path!r}, keep_plain_weights=True, dtype=dtype, block_size=4, num_blocks=256)
    runner = llm.engine.runner
    _batched(llm)
    _batched_close_to_per_op(runner, [(11, 2), (21, 1)])
    runner.model.fused_decode = FusedDecode.build(runner.model, batch=False)
    for rows in (1, 4, 11):
        cache = _same_layout_cache(runner, seed=rows)
        ids, pos, meta = _decode_inputs(rows, cache, seed=rows)
        ref, kv_ref, got, kv_fused = _per_op_and_fused(runner.model, ids, pos, cache, meta)
        assert torch.equal(got, ref) and torch.equal(kv_fused, kv_ref)
print("ok")
"""


def test_avx2_build(tiny_llama_dir, tmp_path):
    """The CI box kind has AVX2 and no AVX-512: every library built for it."""
    skip_in_isa_view()
    if not os.uname().machine.startswith("x86"):
        pytest.skip("x86 -march values")
    env = dict(os.environ, PDSERVE_KERNEL_MARCH="haswell", PYTHONPATH=str(ROOT))
    env["PDSERVE_KERNEL_CACHE"] = str(tmp_path)
    code = _OTHER_BUILD.format(path=tiny_llama_dir)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_plan_keeps_what_it_points_into(tiny_llama_dir):
    """The native plan holds raw pointers: a RoPE table or weight replaced on the model
    after the build must not be freed under it (the plan keeps their storage); a RoPE
    table of another width (the native RoPE reads head_dim floats a position) is not taken."""
    llm = LLM(tiny_llama_dir, keep_plain_weights=True, block_size=4, num_blocks=64)
    runner = llm.engine.runner
    model = runner.model
    fused = model.fused_decode
    table, embed = model.cos_sin.data_ptr(), model.model.embed_tokens.weight.data_ptr()
    model.init_rope(torch.device("cpu"))  # a new table: the model drops the old one
    model.model.embed_tokens.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())
    # tensors sharing the plan's storages (the projections' plain weights kept apart: they
    # go where `release_plain` frees them)
    kept = {t.data_ptr() for t in [*fused._bound, *fused._plain]}
    assert fused._model.cos_sin == table and fused._model.embed == embed
    assert table in kept and embed in kept
    assert all(layer.qkv in kept and layer.down in kept for layer in fused._layers)
    cache = _same_layout_cache(runner, seed=3)
    ids, pos, meta = _decode_inputs(2, cache, seed=3)
    ref, kv_ref, got, kv_fused = _per_op_and_fused(model, ids, pos, cache, meta)
    assert torch.equal(got, ref) and torch.equal(kv_fused, kv_ref)  # same values, kept
    model.cos_sin = model.cos_sin[:, : model.cos_sin.shape[1] // 2].contiguous()
    assert FusedDecode.build(model) is None


def test_a_prompt_step_does_not_outlive_its_step(tiny_llama_dir):
    """The runner plans a step with prompt tokens (no decode GEMV, no fused forward in it)
    for that step only. A generate whose last step was a prompt step (one token to
    generate) once left a module-global mark set: every later decode GEMV or fused call
    outside the runner's steps (another engine's model, a test, a benchmark) silently took
    the per-op path. The plan is an argument now; a decode step still plans the fused path."""
    from pdserve.kernels import gemv

    llm = LLM(tiny_llama_dir, keep_plain_weights=True, block_size=4, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(random_prompts(1, [9], seed=3), params)
    runner = llm.engine.runner
    _, _, meta = _decode_inputs(2, runner.kv_cache, seed=3)
    assert plan_step(runner.model, meta) == StepPlan(ForwardPath.FUSED)
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    assert gemv.linear(x, w, None) is not None


def test_inputs_of_other_row_counts_are_not_taken(tiny_llama_dir):
    """The native chain reads m positions, slots, context lengths and block-table rows:
    metadata with fewer (or a 1-D table) is not taken, nothing read past it."""
    llm = LLM(tiny_llama_dir, keep_plain_weights=True, block_size=4, num_blocks=64)
    runner = llm.engine.runner
    fused = runner.model.fused_decode
    cache = _same_layout_cache(runner, seed=0)
    with torch.inference_mode():
        for rows in (3, 12):
            ids, pos, meta = _decode_inputs(rows, cache, seed=2)
            short = [
                dataclasses.replace(meta, decode_context_lens=meta.decode_context_lens[:-1]),
                dataclasses.replace(meta, decode_block_tables=meta.decode_block_tables[:-1]),
                dataclasses.replace(meta, decode_block_tables=meta.decode_block_tables[0]),
                dataclasses.replace(meta, slot_mapping=meta.slot_mapping[:-1]),
            ]
            for bad in short:
                assert fused(ids, pos, cache, bad) is None
            assert fused(ids, pos[:-1], cache, meta) is None

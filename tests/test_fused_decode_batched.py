"""The fused decode forward's batched path (engine/models/fused_decode.py): decode steps of
9 to 256 rows as one native call on weights packed at load (kernels/gemm_packed.py), close
to the per-op path and independent of the other rows in the step; the packed lm_head.
Split from tests/test_fused_decode.py, whose helpers it shares."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.model_build import prompt_gemm_form
from pdserve.engine.models import cpu_linear
from pdserve.engine.models.cpu_linear import (
    PackedLinear,
    PanelForm,
    is_packed,
    onednn_amx,
    released,
    row_invariant,
)
from pdserve.engine.models.fused_decode import FusedDecode
from pdserve.engine.step_plan import ForwardPath, StepPlan
from pdserve.kernels import gemm_packed
from pdserve.kernels import ops as kernel_ops
from tests.conftest import make_tiny_llama
from tests.hf_reference import hf_greedy, load_hf
from tests.test_compiled_model import _decode_inputs
from tests.test_engine import random_prompts
from tests.test_fused_decode import _per_op_and_fused, _same_layout_cache
from tests.test_gemm_packed import _cpu_flags

pytestmark = pytest.mark.isa  # scripts/avx2_view.sh runs it as an AVX2-only CPU

ROOT = Path(__file__).resolve().parent.parent


def _batched(llm) -> FusedDecode:
    """The runner's fused decode with its batched forward, built with it where the runner
    leaves it off (bf16 on a CPU with AMX: `onednn_amx`), so the path runs on every box."""
    model = llm.engine.runner.model
    if model.fused_decode._batch_fn is None:
        model.fused_decode = FusedDecode.build(model, batch=True)
    assert model.fused_decode._batch_fn is not None
    return model.fused_decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_runner_leaves_the_batched_forward_off_only_for_bf16_on_amx(
    tmp_path, tiny_llama_dir, dtype
):
    """Where oneDNN runs bf16 on AMX tiles its GEMMs outrun the panel GEMM on vdpbf16ps
    from 8 rows on (benchmarks/weight_forms.py: 5-10x at 64-512 rows), so decode steps
    stay on them and the panel copy is not made, unless the panel GEMM runs on AMX tiles
    too (every projection's K a multiple of 32): then it streams the weights faster than
    oneDNN at decode row counts and the batched forward is built. Everywhere else it is."""
    # the tiny model's K: 64 (hidden, heads x head dim) and 128 (intermediate): whole tiles;
    # a down projection of K 80 has none
    odd = make_tiny_llama(str(tmp_path / "odd"), intermediate_size=80)
    for path, k in ((tiny_llama_dir, 128), (odd, 80)):
        llm = LLM(path, keep_plain_weights=True, dtype=str(dtype).removeprefix("torch."),
                  block_size=4, num_blocks=512)  # fmt: skip
        fused = llm.engine.runner.model.fused_decode
        amx_panels = gemm_packed.bf16_amx(64) and gemm_packed.bf16_amx(k)
        assert amx_panels == (k == 128 and gemm_packed.bf16_amx(64))
        off = onednn_amx(dtype) and not amx_panels
        assert (fused._batch_fn is None, fused.lm_head is None, not fused._packed) == (off,) * 3
    assert onednn_amx(dtype) == (dtype == torch.bfloat16 and not row_invariant(dtype))


def test_bf16_panels_on_amx_tiles_where_the_cpu_has_them():
    """The bf16 panel GEMM runs on AMX tiles where the CPU has them (the library built for
    it, the tile state granted), for a K that fills whole tiles."""
    if os.environ.get("PDSERVE_KERNEL_MARCH"):
        pytest.skip("the library is built for another CPU than this one")
    amx = "amx_bf16" in _cpu_flags() and "avx512_bf16" in _cpu_flags()
    assert gemm_packed.bf16_amx(576) == amx and gemm_packed.bf16_amx(1536) == amx
    assert not gemm_packed.bf16_amx(48) and not gemm_packed.bf16_amx(0)


def test_plain_projection_weights_freed_where_both_packed_copies_hold_them(tiny_llama_dir):
    """fp32 (oneDNN packs every projection, the batched forward is built): the runner frees
    the plain projection weights; every decode step, 1 row on, runs the batched forward,
    prompt steps oneDNN's copy, and a decode step the fused path declines runs op by op on
    oneDNN's copy too; greedy tokens equal Hugging Face's throughout. The tied lm_head (the
    embedding's table) stays plain, its oneDNN copy dropped: every lm_head call runs the
    panel copy. `keep_plain_weights=True` keeps them all."""
    hf = load_hf(tiny_llama_dir)
    llm = LLM(tiny_llama_dir, prompt_gemm="onednn", block_size=4, num_blocks=512)
    model = llm.engine.runner.model
    fused = model.fused_decode
    linears = [m.weight for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * len(model.model.layers)
    assert all(released(w) and w.untyped_storage().nbytes() == 4 for w in linears)
    # oneDNN's copies, for the prompt steps
    assert all(is_packed(w) and not isinstance(cpu_linear._packed(w), PanelForm) for w in linears)
    assert not released(model.model.embed_tokens.weight)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for n in (1, 3, 10):
        prompts = random_prompts(n, [5, 40, 17], seed=n)
        for p, o in zip(prompts, llm.generate(prompts, params)):
            assert o.token_ids == hf_greedy(hf, p, params.max_tokens)
    assert fused.steps == 0 and fused.batch_steps >= 3 * (params.max_tokens - 1)
    # every lm_head call on the panel copy, prompt steps' too: oneDNN's copy was dropped
    assert not is_packed(model.lm_head_weight) and not released(model.lm_head_weight)
    calls, panel = [], fused.lm_head.linear
    fused.lm_head.linear = lambda x: calls.append(x.shape[0]) or panel(x)
    try:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    finally:
        del fused.lm_head.linear
    assert calls == [2, 2], calls  # the prompt step, then the decode step
    model.fused_decode = None  # every decode step op by op: the GEMVs decline released weights
    for p, o in zip(prompts[:3], llm.generate(prompts[:3], params)):
        assert o.token_ids == hf_greedy(hf, p, params.max_tokens)
    llm.engine.check_integrity()
    keep = LLM(tiny_llama_dir, prompt_gemm="onednn", keep_plain_weights=True, block_size=4,
               num_blocks=64)  # fmt: skip
    kept = keep.engine.runner.model
    assert not any(released(m.weight) for m in kept.modules() if isinstance(m, PackedLinear))
    assert kept.fused_decode.batch_from == 8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_steps_on_the_panel_copies(tiny_llama_dir, monkeypatch, dtype):
    """`prompt_gemm="panel"`: no oneDNN copy is made; prompt steps (and every decode step)
    run the batched forward's panel copies and the plain projections are freed, so each
    projection is held once. fp32: greedy tokens equal Hugging Face's, for prompts of one
    token (a lone row) and a prompt computed again from the prefix cache (its last token
    alone) too. bf16: the first token equals the default engine's (oneDNN for prompts where
    the CPU has native bf16), and a request run twice gives the same tokens."""
    if dtype == "bfloat16" and onednn_amx(torch.bfloat16):
        pytest.skip("bf16 on AMX: no batched forward here, prompts stay on oneDNN")
    llm = LLM(tiny_llama_dir, dtype=dtype, prompt_gemm="panel", block_size=4, num_blocks=512)
    model = llm.engine.runner.model
    linears = [m.weight for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * len(model.model.layers)
    assert all(released(w) for w in linears)
    assert all(isinstance(cpu_linear._packed(w), PanelForm) for w in linears)
    assert cpu_linear._packed(model.lm_head_weight) is None  # the logits: the panel copy
    rows = []
    call = PanelForm.__call__
    monkeypatch.setattr(PanelForm, "__call__", lambda f, x, b: rows.append(len(x)) or call(f, x, b))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[7], *random_prompts(3, [5, 40, 17], seed=3)]
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert max(rows) == 1 + 5 + 40 + 17  # the prompt step: all four prompts' tokens at once
    again = [o.token_ids for o in llm.generate(prompts[2:3], params)]  # the prefix cache's
    assert again == outs[2:3]
    if dtype == "float32":
        hf = load_hf(tiny_llama_dir)
        assert outs == [hf_greedy(hf, p, params.max_tokens) for p in prompts]
    else:
        ref = LLM(tiny_llama_dir, dtype=dtype, prompt_gemm="onednn", block_size=4,
                  num_blocks=512)  # fmt: skip
        assert [o[0] for o in outs] == [r.token_ids[0] for r in ref.generate(prompts, params)]
    llm.engine.check_integrity()


@pytest.mark.parametrize(
    "bits,amx,bf16_native,want",
    [
        (512, False, True, ("panel", "panel")),  # Zen 4: measured as fast
        (512, False, False, ("panel", "onednn")),  # bf16 widened to fp32: not measured
        (512, True, True, ("onednn", "onednn")),  # a Xeon with AMX: the panels slower
        (256, False, False, ("panel", "panel")),  # AVX2: fp32 as fast, bf16 faster
        (256, True, False, ("onednn", "onednn")),  # a Haswell build on an AMX CPU
        (32, False, False, ("onednn", "onednn")),  # plain C++: not measured
    ],
)
def test_prompt_gemm_auto_by_the_cpu(monkeypatch, bits, amx, bf16_native, want):
    """`prompt_gemm: auto` is the panel copies where they measured as fast as oneDNN's, by
    the library's vector width, AMX and native bf16 (fp32, bf16); a setting other than auto
    is taken as it is."""
    monkeypatch.setattr(kernel_ops, "packed_vector_bits", lambda: bits)
    monkeypatch.setattr(kernel_ops, "packed_bf16_native", lambda: bf16_native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    got = tuple(prompt_gemm_form("auto", d) for d in (torch.float32, torch.bfloat16))
    assert got == want
    assert prompt_gemm_form("auto", torch.float16) == "onednn"  # the panels hold fp32, bf16
    for setting in ("onednn", "panel"):
        assert prompt_gemm_form(setting, torch.float32) == setting


def test_the_default_engine_holds_one_form_where_auto_picks_the_panels(tiny_llama_dir):
    """The default engine (`prompt_gemm: auto`) on this CPU: one form of each projection (no
    oneDNN copy, the plain weights freed) where auto resolves to the panels, as on an
    AVX2 or AVX-512 CPU without AMX; oneDNN's copy beside the panels elsewhere; greedy tokens equal
    Hugging Face's either way."""
    form = prompt_gemm_form("auto", torch.float32)
    if not os.environ.get("PDSERVE_KERNEL_MARCH"):  # the library built for this CPU
        flags = _cpu_flags()
        assert (form == "panel") == ("avx2" in flags and "amx_tile" not in flags)
    llm = LLM(tiny_llama_dir, block_size=4, num_blocks=256)
    model = llm.engine.runner.model
    linears = [m.weight for m in model.modules() if isinstance(m, PackedLinear)]
    forms = [cpu_linear._packed(w) for w in linears]
    assert [isinstance(f, PanelForm) for f in forms] == [form == "panel"] * len(linears)
    assert all(f is not None for f in forms)  # oneDNN's copy where not the panels
    if form == "panel":
        assert all(released(w) for w in linears)
    hf = load_hf(tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(3, [5, 40, 17], seed=11)
    for p, o in zip(prompts, llm.generate(prompts, params)):
        assert o.token_ids == hf_greedy(hf, p, params.max_tokens)
    llm.engine.check_integrity()


def test_bf16_plain_weights_freed_where_the_panels_run_on_amx(tiny_llama_dir):
    """bf16 on a CPU with AMX: oneDNN packs every projection and the batched forward runs
    its panels on AMX tiles, so the runner frees the plain weights as in fp32: every decode
    step, 1 row on, runs the batched forward; greedy tokens as the engine that keeps them
    (1-8 row steps on the plain-weight GEMVs) gives but where bf16 rounding in other
    places may flip a near-tie: the first token always, most of the rest."""
    if not (onednn_amx(torch.bfloat16) and gemm_packed.bf16_amx(64) and gemm_packed.bf16_amx(128)):
        pytest.skip("no AMX tiles here: bf16 keeps its plain weights (the test above)")
    llm = LLM(tiny_llama_dir, dtype="bfloat16", block_size=4, num_blocks=512)
    model = llm.engine.runner.model
    linears = [m.weight for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(released(w) for w in linears) and model.fused_decode.batch_from == 0
    keep = LLM(tiny_llama_dir, keep_plain_weights=True, dtype="bfloat16", block_size=4,
               num_blocks=512)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for n in (1, 3):
        prompts = random_prompts(n, [5, 40, 17], seed=20 + n)
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        ref = [o.token_ids for o in keep.generate(prompts, params)]
        assert all(o[0] == r[0] for o, r in zip(outs, ref))
        same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r))
        assert same >= 0.9 * params.max_tokens * n, same
    assert model.fused_decode.steps == 0 and model.fused_decode.batch_steps >= 20
    assert keep.engine.runner.model.fused_decode.steps >= 20  # 1-3 rows: the GEMVs
    llm.engine.check_integrity()


def test_engine_takes_the_batched_forward_in_bf16(tiny_llama_dir):
    """bf16 decode steps of more than MAX_ROWS rows run batched in the engine, and greedy
    decoding through them gives what the per-layer path (oneDNN's bf16 GEMMs) gives but
    where bf16 rounding in other places may flip a near-tie: the first token (the prompt's,
    not a decode step's) always, most of the rest."""
    llm = LLM(
        tiny_llama_dir, keep_plain_weights=True, dtype="bfloat16", block_size=4, num_blocks=512
    )
    model = llm.engine.runner.model
    fused = _batched(llm)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(10, [3, 9, 20], seed=12)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert fused.batch_steps >= 10, fused.batch_steps
    model.fused_decode = by_layer = FusedDecode.build(model, batch=False)
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    assert by_layer.layer_steps >= 10 and by_layer.batch_steps == 0
    assert all(len(o) == params.max_tokens and o[0] == r[0] for o, r in zip(outs, ref))
    same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r))
    assert same >= 0.9 * params.max_tokens * len(prompts), same
    llm.engine.check_integrity()


def _batched_close_to_per_op(runner, cases) -> None:
    """The batched forward (packed GEMMs) against the per-op path: hidden states and the
    K/V it stores equal but for summation order (bf16: and the bf16 roundings it moves)."""
    model = runner.model
    fused = model.fused_decode
    dtype = model.model.embed_tokens.weight.dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows, threads in cases:
        torch.set_num_threads(threads)
        cache = _same_layout_cache(runner, seed=rows)
        ids, pos, meta = _decode_inputs(rows, cache, seed=rows)
        batch_steps = fused.batch_steps
        ref, kv_ref, got, kv_fused = _per_op_and_fused(model, ids, pos, cache, meta)
        assert fused.batch_steps == batch_steps + 1, "the batched forward did not run"
        assert got.shape == ref.shape and got.dtype == dtype
        got, ref, kv_got, kv_want = got.float(), ref.float(), kv_fused.float(), kv_ref.float()
        scale = ref.abs().max().item()
        assert (got - ref).abs().max().item() <= tol * scale, (rows, threads)
        assert (kv_got - kv_want).abs().max().item() <= tol * kv_want.abs().max().item()
        if dtype == torch.bfloat16:
            # Most values the same bf16 number: both round at the same points (the batched
            # forward follows the per-op path's roundings, `silu_mode`); they differ where
            # the per-op GEMMs' summation order (oneDNN's, or torch's own bf16 GEMM on a CPU
            # without native bf16) moves an fp32 sum across a bf16 rounding boundary, and
            # what a flipped last bit then changes downstream. Measured: 1.0 on AVX-512
            # bf16 boxes, 0.977-1.0 on AVX2 (tests/test_fused_decode.py's cases).
            assert (got == ref).float().mean().item() > 0.9
        assert not torch.equal(kv_fused, cache), "nothing was stored"
    torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_batched_forward_close_to_per_op(tiny_llama_dir, layout, dtype):
    llm = LLM(
        tiny_llama_dir,
        keep_plain_weights=True,
        dtype=dtype,
        block_size=4,
        num_blocks=512,
        kv_layout=layout,
    )
    _batched(llm)
    _batched_close_to_per_op(llm.engine.runner, [(9, 1), (9, 2), (33, 2), (64, 2)])


def test_batched_bf16_rounds_as_the_unfused_per_op_mlp(tiny_llama_dir, monkeypatch):
    """Where oneDNN cannot pack bf16 (a CPU without native bf16: AVX2-only boxes; here the
    runner is told so), the per-op MLP rounds the gate_up GEMM's output to bf16 before
    SiLU * up, and the batched forward rounds there too (`silu_mode` 2): it stays as close
    to the per-op path as where oneDNN fuses SiLU * up. (It kept the fused rounding and
    matched a quarter of the elements on AVX2.) The GEMMs' summation order is torch's on
    such a CPU, hence "close", not equal (scripts/avx2_view.sh runs this on AVX2 itself)."""
    from pdserve.engine import model_build

    monkeypatch.setattr(model_build, "onednn_available", lambda device, dtype: False)
    # prompt_gemm: what `auto` is on such a CPU (no native bf16)
    llm = LLM(tiny_llama_dir, keep_plain_weights=True, dtype="bfloat16", block_size=4,
              num_blocks=512, prompt_gemm="onednn")  # fmt: skip
    runner = llm.engine.runner
    assert _batched(llm)._model.silu_mode == 2
    _batched_close_to_per_op(runner, [(9, 1), (33, 2), (64, 2)])
    # greedy through the engine: what the per-layer path (the per-op GEMMs) gives
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(10, [3, 9, 20], seed=12)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert runner.model.fused_decode.batch_steps >= 10
    runner.model.fused_decode = FusedDecode.build(runner.model, batch=False)
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    assert all(len(o) == params.max_tokens and o[0] == r[0] for o, r in zip(outs, ref))
    same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r))
    assert same >= 0.9 * params.max_tokens * len(prompts), same
    llm.engine.check_integrity()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_rows_do_not_depend_on_the_step(tiny_llama_dir, dtype):
    """A row's hidden states and stored K/V are the same bits whatever other rows share its
    step and however many threads run it (each GEMM output one FMA chain over k in order;
    norms, RoPE and attention per row), steps of fewer rows than threads included (the
    batched forward's rows from 1 on, as after `release_plain`)."""
    llm = LLM(tiny_llama_dir, keep_plain_weights=True, dtype=dtype, block_size=4, num_blocks=512)
    runner = llm.engine.runner
    model, fused = runner.model, _batched(llm)
    cache = _same_layout_cache(runner, seed=5)
    ids, pos, meta = _decode_inputs(40, cache, seed=6)
    fused.batch_from = 0
    outs = []
    with torch.inference_mode():
        for rows, threads in [(40, 2), (9, 1), (17, 2), (40, 1), (1, 2), (3, 2), (1, 1)]:
            torch.set_num_threads(threads)
            sub = AttentionMetadata(
                meta.slot_mapping[:rows], rows, meta.decode_block_tables[:rows].contiguous(),
                meta.decode_context_lens[:rows], meta.prefill_block_tables,
                meta.prefill_query_start_loc, meta.prefill_seq_lens,
            )  # fmt: skip
            kv = cache.clone()
            before = fused.batch_steps
            outs.append((model(ids[:rows], pos[:rows], kv, sub), kv))
            assert fused.batch_steps == before + 1
    torch.set_num_threads(1)
    full, kv_full = outs[0]
    for hidden, _kv in outs[1:]:
        assert torch.equal(hidden, full[: hidden.shape[0]])
    assert torch.equal(outs[3][0], full) and torch.equal(outs[3][1], kv_full)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_lm_head(tiny_llama_dir, dtype):
    """The logits of the batched step just run come from the packed lm_head (close to
    oneDNN's; bf16: fp32 holding bf16 values, as the model's own bf16 logits turned
    float); any other call (a second one, prompt steps, other row counts) keeps the
    model's own GEMMs."""
    from pdserve.engine.models.cpu_linear import linear

    llm = LLM(tiny_llama_dir, keep_plain_weights=True, dtype=dtype, block_size=4, num_blocks=512)
    runner = llm.engine.runner
    model, fused = runner.model, _batched(llm)
    cache = _same_layout_cache(runner, seed=8)
    ids, pos, meta = _decode_inputs(12, cache, seed=8)
    with torch.inference_mode():
        hidden = model(ids, pos, cache, meta)
        assert fused._batched_rows == 12
        ref = linear(hidden, model.lm_head_weight, None).float()
        tol = 1e-5 if dtype == "float32" else 1e-2
        calls = []
        packed_linear = fused.lm_head.linear
        fused.lm_head.linear = lambda x: calls.append(x.shape) or packed_linear(x)
        got = model.compute_logits(hidden)  # the packed lm_head
        assert calls == [(12, model.config.hidden_size)]
        assert got.dtype == torch.float32
        assert (got - ref).abs().max().item() <= tol * ref.abs().max().item()
        assert torch.equal(got.to(model.lm_head_weight.dtype).float(), got)
        assert torch.equal(model.compute_logits(hidden), ref)  # a second call: oneDNN's
        assert len(calls) == 1
        model(ids, pos, cache, meta)
        assert fused.logits(hidden[:8]) is None  # not the step's rows
        model(ids, pos, cache, meta)
        prompt_step = StepPlan(ForwardPath.PER_OP, gemv=False)  # the runner's, prompt tokens
        assert torch.equal(model.compute_logits(hidden, prompt_step), ref)
        assert len(calls) == 1


def test_batched_rows_do_not_depend_on_the_step_long_contexts(tmp_path):
    """Long contexts and more threads than a few rows each: attention stays one key split
    per row in the batched forward (the per-op path splits keys to keep threads busy), so a
    row's bits still do not depend on the thread count or the other rows."""
    path = make_tiny_llama(str(tmp_path / "m"), seed=5)
    llm = LLM(path, keep_plain_weights=True, block_size=16, num_blocks=512)
    runner = llm.engine.runner
    model, fused = runner.model, runner.model.fused_decode
    cache = _same_layout_cache(runner, seed=9)
    g = torch.Generator().manual_seed(2)
    rows, width = 11, 30
    tables = torch.randperm(512, generator=g)[: rows * width].to(torch.int32).reshape(rows, width)
    lens = torch.randint(256, 470, (rows,), generator=g, dtype=torch.int32)
    lens[3] = 20  # a short one among the long
    pos = (lens - 1).long()
    slots = tables[torch.arange(rows), pos // 16].long() * 16 + pos % 16
    ids = torch.randint(0, 1000, (rows,), generator=g)
    outs = []
    with torch.inference_mode():
        for n, threads in [(11, 1), (11, 4), (9, 3), (10, 2)]:
            torch.set_num_threads(threads)
            meta = AttentionMetadata(
                slots[:n], n, tables[:n].contiguous(), lens[:n], tables[:0],
                torch.zeros(1, dtype=torch.int32), lens[:0],
            )  # fmt: skip
            before = fused.batch_steps
            outs.append(model(ids[:n], pos[:n], cache.clone(), meta))
            assert fused.batch_steps == before + 1
    torch.set_num_threads(1)
    for hidden in outs[1:]:
        assert torch.equal(hidden, outs[0][: hidden.shape[0]])


def test_batched_decode_switched_off(tiny_llama_dir, tmp_path):
    """`batched_decode=False` (`--no-batched-decode`, YAML `model.batched_decode: false`):
    no packed copies, larger steps by layer."""
    from tests.test_cluster_config import GOOD, node_engine_config, write

    llm = LLM(
        tiny_llama_dir, keep_plain_weights=True, block_size=4, num_blocks=512, batched_decode=False
    )
    fused = llm.engine.runner.model.fused_decode
    assert fused._batch_fn is None and fused.lm_head is None and not fused._packed
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(random_prompts(10, [3, 9, 20], seed=12), params)
    assert fused.layer_steps >= 3 and fused.batch_steps == 0

    def batched(argv: list[str]) -> bool:
        return node_engine_config(argv).model.batched_decode

    assert batched([]) is True and batched(["--no-batched-decode"]) is False
    path = write(tmp_path, GOOD)
    assert batched(["--config", str(path), "--node", "decode-0"]) is True
    argv = ["--config", str(path), "--node", "decode-0", "--set", "model.batched_decode=false"]
    assert batched(argv) is False

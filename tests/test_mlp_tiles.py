"""The MLP of a long CPU step runs in row tiles (engine/models/llama.py, mlp_tile_rows):
same result as one untiled call and as plain torch, in fp32 and bf16, with the
weights prepacked for oneDNN as the engine runs them (where oneDNN can pack them: bf16 on
a CPU without native bf16 runs the plain `F.linear`, and SiLU * up unfused, as the engine
does there)."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_arch import ModelArch
from pdserve.engine.models.cpu_linear import onednn_available
from pdserve.engine.models.llama import LlamaMLP, mlp_tile_rows
from pdserve.kernels import cpu_ops
from tests.hf_reference import hf_greedy, load_hf

pytestmark = pytest.mark.isa  # scripts/avx2_view.sh runs it as an AVX2-only CPU

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
# vs plain fp32 torch: bf16 rounds gate_up's output and SiLU*mul's before down
PLAIN_TOL = {torch.float32: TOL[torch.float32], torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


def make_mlp(dtype: torch.dtype, hidden: int = 96, inter: int = 256) -> LlamaMLP:
    cfg = ModelArch.from_dict(
        dict(vocab_size=10, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, tie_word_embeddings=True)
    )  # fmt: skip
    mlp = LlamaMLP(cfg, cpu_ops)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    mlp = mlp.to(dtype)
    packable = onednn_available(torch.device("cpu"), dtype)
    assert mlp.gate_up_proj.pack() == packable and mlp.down_proj.pack() == packable
    return mlp


def plain(mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x.float(), mlp.gate_up_proj.weight.float()).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, mlp.down_proj.weight.float())


@contextmanager
def gate_up_rows(mlp: LlamaMLP):
    """Rows of each gate_up call of `mlp`: the fused path (PackedGateUp.silu_mul, SiLU * up
    as oneDNN post-ops) or the plain projection."""
    rows: list[int] = []
    proj = mlp.gate_up_proj
    silu_mul = proj.silu_mul

    def counted(x):
        out = silu_mul(x)
        if out is not None:
            rows.append(x.shape[0])
        return out

    proj.silu_mul = counted
    hook = proj.register_forward_hook(lambda m, a, out: rows.append(a[0].shape[0]))
    try:
        yield rows
    finally:
        hook.remove()
        del proj.silu_mul


def gate_up_calls(mlp: LlamaMLP, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    with gate_up_rows(mlp) as rows:
        return mlp(x), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows,tile,expected_tiles",
    [
        (333, 100, [84, 84, 84, 81]),
        (1100, 1024, [550, 550]),
        (64, 100, [64]),
        (200, 100, [100, 100]),
    ],
)
def test_tiled_mlp_equals_untiled(rows, tile, expected_tiles, dtype):
    mlp = make_mlp(dtype)
    x = torch.randn((rows, 96), generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        mlp.tile_rows = 0
        whole, whole_calls = gate_up_calls(mlp, x)
        mlp.tile_rows = tile
        tiled, tiled_calls = gate_up_calls(mlp, x)
        expected = plain(mlp, x)
    assert whole_calls == [rows]
    assert tiled_calls == expected_tiles  # equal tiles, every row once
    assert tiled.dtype == dtype and tiled.shape == (rows, 96)
    torch.testing.assert_close(tiled, whole, **TOL[dtype])
    torch.testing.assert_close(tiled.float(), expected, **PLAIN_TOL[dtype])


def test_default_tile_holds_the_intermediate_in_cache():
    assert mlp_tile_rows(1536, torch.float32) == 2048  # SmolLM2: 24 MiB of gate_up output
    assert mlp_tile_rows(1536, torch.bfloat16) == 4096
    assert mlp_tile_rows(14336, torch.float32) == 256  # a wide MLP: not below 256 rows
    mlp = make_mlp(torch.float32)
    assert mlp.tile_rows is None  # the default
    tile = mlp_tile_rows(256, torch.float32)
    x = torch.randn(2 * tile - 2, 96)
    with torch.inference_mode():
        _, calls = gate_up_calls(mlp, x)
    assert calls == [tile - 1] * 2


def test_engine_step_over_a_tile_is_token_identical_to_hf(tiny_llama_dir):
    """A prefill step of 3 x 400 tokens runs every layer's MLP in three tiles; greedy output
    still equals Hugging Face's."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1024) for _ in range(400)] for _ in range(3)]
    llm = LLM(tiny_llama_dir, block_size=16, num_blocks=128, max_num_batched_tokens=2048)
    for layer in llm.engine.runner.model.model.layers:
        layer.mlp.tile_rows = 512  # the tiny model's default tile is larger than the step
    mlp = llm.engine.runner.model.model.layers[0].mlp
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with gate_up_rows(mlp) as rows:
        outs = llm.generate(prompts, params)
    assert rows[:3] == [400, 400, 400]  # the 1200-token prefill step, in three tiles
    hf = load_hf(tiny_llama_dir)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 4)

"""The CUDA path's load-time and launch logic, checked on CPU where it can be.

What only a GPU can show (Triton compiled, cuda:N, the step event before NIXL WRITEs,
VRAM transfers) is checked by benchmarks/gpu_check.py; its --dry-run runs here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated

from pdserve.common.errors import ConfigError  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.config import ModelConfig  # noqa: E402
from pdserve.engine.model_arch import ModelArch  # noqa: E402
from pdserve.engine.model_build import build_model  # noqa: E402
from pdserve.engine.models.rope import build_cos_sin_cache  # noqa: E402
from pdserve.engine.request import Request  # noqa: E402
from pdserve.kernels.ops import DECODE_MAX_SPLITS, get_ops  # noqa: E402
from tests.conftest import make_tiny_llama  # noqa: E402
from tests.hf_reference import hf_greedy, load_hf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # tiny, so most frequencies are rescaled
}


def test_seeded_generator_lives_on_the_logits_device():
    params = SamplingParams(temperature=1.0, seed=7)
    req = Request("r", [1, 2, 3], params, block_size=4)
    logits = torch.randn(1, 50)
    gen = req.generator(logits.device)
    assert gen is not None and gen.device == logits.device
    # One generator per request, re-seeded from (seed, position) on every draw: the same
    # position draws the same token however many steps were taken before it.
    first = torch.multinomial(logits.softmax(-1)[0], 1, generator=gen)
    again = req.generator(logits.device)
    assert again is gen
    assert torch.multinomial(logits.softmax(-1)[0], 1, generator=again).equal(first)
    assert Request("u", [1], SamplingParams(temperature=1.0), 4).generator(logits.device) is None
    if torch.cuda.is_available():
        cuda_logits = logits.cuda()
        g = Request("c", [1], params, 4).generator(cuda_logits.device)
        assert g.device == cuda_logits.device
        torch.multinomial(cuda_logits.softmax(-1)[0], 1, generator=g)  # no device error


@pytest.fixture(scope="module", params=["rope_parameters", "rope_scaling"])
def llama3_dir(request, tmp_path_factory) -> str:
    """transformers 5 writes `rope_parameters`; Llama-3.x checkpoints ship the older
    `rope_scaling` with a top-level `rope_theta`. Both must load."""
    path = make_tiny_llama(
        str(tmp_path_factory.mktemp("tiny_llama3")), rope_scaling=dict(LLAMA3_ROPE)
    )
    if request.param == "rope_scaling":
        cfg_path = Path(path) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope
        cfg_path.write_text(json.dumps(cfg))
    return path


def test_llama3_rope_scaling_loads_and_matches_hf_greedy(llama3_dir):
    arch = ModelArch.from_dir(llama3_dir)
    assert arch.rope_parameters["rope_type"] == "llama3"
    plain = {k: v for k, v in arch.raw.items() if k not in ("rope_parameters", "rope_scaling")}
    default = ModelArch.from_dict({**plain, "rope_theta": 10000.0})
    assert default.rope_parameters["rope_type"] == "default"
    # The scaling changes the table (low frequencies stretched), so a model that ignored
    # it would not match transformers' greedy tokens on the long prompt below.
    assert not torch.allclose(build_cos_sin_cache(arch), build_cos_sin_cache(default))
    llm = LLM(llama3_dir, block_size=4, num_blocks=200, max_num_batched_tokens=64)
    hf = load_hf(llama3_dir)
    prompts = [[1, 5, 9], [(7 * i) % 1000 + 3 for i in range(300)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.token_ids == hf_greedy(hf, prompt, 8), f"prompt len {len(prompt)}"
    llm.engine.check_integrity()


def test_unsupported_head_dim_is_refused_at_load_naming_the_field(tmp_path):
    # hidden 96 / 4 heads = head_dim 24: not a power of two, so no Triton kernel runs it.
    path = make_tiny_llama(str(tmp_path / "hd24"), hidden_size=96)
    with pytest.raises(ConfigError) as err:
        LLM(path, kernel_backend="triton", block_size=4, num_blocks=16)
    assert err.value.field == "head_dim"
    assert "24" in str(err.value) and "kernel_backend: torch" in str(err.value)
    # The torch kernels run it, and match transformers.
    llm = LLM(path, kernel_backend="torch", block_size=4, num_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate([[1, 2, 3, 4, 5]], params)
    assert out.token_ids == hf_greedy(load_hf(path), [1, 2, 3, 4, 5], 4)


class _AllocationLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the dtype and size of every real (non-meta) tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.allocs: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.allocs.append((t.dtype, t.numel()))
        return out


def test_weights_are_allocated_in_the_target_dtype_only(tiny_llama_dir):
    arch = ModelArch.from_dir(tiny_llama_dir)
    with _AllocationLog() as log:
        model = build_model(arch, get_ops("torch"), torch.device("cpu"), torch.bfloat16)
    embed = arch.vocab_size * arch.hidden_size
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert any(dt == torch.bfloat16 and n == embed for dt, n in log.allocs)
    # No fp32 copy of any weight matrix was ever materialised (only small RoPE scratch).
    biggest_fp32 = max((n for dt, n in log.allocs if dt == torch.float32), default=0)
    assert biggest_fp32 < arch.hidden_size * arch.hidden_size


def test_device_and_dtype_defaults():
    assert ModelConfig(device="cpu").dtype_name == "float32"
    assert ModelConfig(device="cuda:0").dtype_name == "bfloat16"
    assert ModelConfig(device="cuda", dtype="float32").dtype_name == "float32"
    with pytest.raises(ConfigError, match="model.dtype"):
        ModelConfig(dtype="float8")


def test_missing_gpu_is_refused_at_load_naming_the_field(tiny_llama_dir):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError) as err:
        LLM(tiny_llama_dir, device=f"cuda:{n}", block_size=4, num_blocks=16)
    assert err.value.field == "model.device"


def test_decode_launches_compile_two_variants_at_most():
    pytest.importorskip("triton")
    from pdserve.kernels.triton_attention import decode_constexprs, decode_split, default_num_splits

    variants, splits_seen = set(), set()
    for batch in (1, 2, 3, 5, 8, 13, 32, 64, 200):
        for capacity in (16, 48, 256, 300, 1024, 4000, 8192, 32768, 131072):
            splits, split_len = decode_split(capacity, default_num_splits(batch, 2, capacity), 64)
            assert splits * split_len >= capacity and split_len % 64 == 0
            splits_seen.add(splits)
            variants.add(tuple(decode_constexprs(4, 128, 16, 64, splits, False).items()))
    assert len(variants) == 2  # with and without split-K
    assert splits_seen <= {2**i for i in range(DECODE_MAX_SPLITS.bit_length())}
    assert max(splits_seen) == DECODE_MAX_SPLITS and 1 in splits_seen


def test_warm_up_runs_every_kernel_path_and_writes_no_kv(tiny_llama_dir):
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled, or interpreted
    llm = LLM(tiny_llama_dir, device=device, kernel_backend="triton", block_size=4, num_blocks=64)
    runner = llm.engine.runner
    runner.warm_up()
    assert not runner.kv_cache.any()  # dummy rows carry slot -1: nothing stored
    llm.engine.check_integrity()
    runner.wait_step_done()  # CPU: nothing to wait for, returns at once


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        # every section but one of the two engine_fp32 ones (the same code on another tiny
        # model; the suite runs the Triton engine itself): 6x slower beside the suite
        [
            sys.executable,
            "benchmarks/gpu_check.py",
            "--dry-run",
            "--out",
            str(out),
            "--only",
            "engine_fp32_hd64,engine_bf16,engine_seeded,engine_load,engine_second,engine_tp2,"
            "pytest,pd_,nixl_,kernels_",
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] is True and result["failures"] == []
    assert result["sections"], "no section ran"
    for name, sec in result["sections"].items():
        assert sec["status"] in ("passed", "skipped"), (name, sec)
        if sec["status"] == "skipped":
            assert sec["reason"], name

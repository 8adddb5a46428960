"""gpu_check sections on the engine: tokens vs transformers, backends, seeds, load memory."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from benchmarks._gpu_common import Skip, first_mismatch, hf_greedy, random_prompts, tiny_llama

logger = logging.getLogger("gpu_check.engine")

# name -> tiny model (head_dim = hidden / heads) on a GPU, and in a dry run
MODELS = {
    "hd128_gqa8to2": (
        dict(hidden=1024, heads=8, kv_heads=2),
        dict(hidden=128, heads=8, kv_heads=2),
    ),
    "hd64_gqa9to3": (dict(hidden=576, heads=9, kv_heads=3), dict(hidden=144, heads=9, kv_heads=3)),
}
GPU_LENGTHS = [1, 15, 16, 17, 300, 1500]
DRY_LENGTHS = [1, 15, 16, 17, 40]  # no split-K (needs >= 512 keys): too slow interpreted


def sections(ctx: dict) -> list:
    out = [(f"engine_fp32_{name}", lambda n=name: fp32_vs_hf(ctx, n)) for name in MODELS]
    return out + [
        ("engine_bf16_backends", lambda: bf16_backends(ctx)),
        ("engine_seeded", lambda: seeded(ctx)),
        ("engine_load_memory", lambda: load_memory(ctx)),
        ("engine_second_gpu", lambda: second_gpu(ctx)),
    ]


def model_dir(ctx: dict, name: str) -> str:
    path = Path(ctx["workdir"]) / name
    if not (path / "config.json").exists():
        gpu, dry = MODELS[name]
        spec = gpu if ctx["cuda"] else dry
        vocab, max_pos = (2048, 2048) if ctx["cuda"] else (512, 1024)
        tiny_llama(str(path), vocab=vocab, max_pos=max_pos, **spec)
    return str(path)


def make_llm(ctx: dict, name: str, **kw):
    from pdserve.engine import LLM

    kw.setdefault("max_num_batched_tokens", 256 if ctx["cuda"] else 32)
    kw.setdefault("num_blocks", 512 if ctx["cuda"] else 128)
    return LLM(model_dir(ctx, name), device=ctx["device"], block_size=16, **kw)


class _SplitProbe:
    """Records the largest split-K count the decode kernel was launched with."""

    def __init__(self):
        from pdserve.kernels import triton_attention

        self.module = triton_attention
        self.original = triton_attention.default_num_splits
        self.max_splits = 0

    def __enter__(self):
        def probe(*args):
            n = self.original(*args)
            self.max_splits = max(self.max_splits, n)
            return n

        self.module.default_num_splits = probe
        return self

    def __exit__(self, *exc):
        self.module.default_num_splits = self.original


def fp32_vs_hf(ctx: dict, name: str) -> dict:
    """Greedy tokens of the Triton engine == transformers', fp32 (TF32 off)."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine import SamplingParams

    dev = ctx["device"]
    lengths = GPU_LENGTHS if ctx["cuda"] else DRY_LENGTHS
    new = 16 if ctx["cuda"] else 6
    vocab = 2048 if ctx["cuda"] else 512
    llm = make_llm(ctx, name, dtype="float32", kernel_backend="triton")
    hf = AutoModelForCausalLM.from_pretrained(model_dir(ctx, name), dtype=torch.float32)
    hf = hf.to(dev).eval()
    prompts = random_prompts(lengths, vocab, seed=len(name))
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    with _SplitProbe() as probe:
        outs = llm.generate(prompts, params)
        # A prefix hit: the longest prompt's first 60 % again, with a new tail.
        longest = prompts[-1]
        again_prompt = longest[: len(longest) * 3 // 5] + [5, 6, 7]
        (again,) = llm.generate([again_prompt], params)
    rows, failed = [], False
    for prompt, out in [*zip(prompts, outs), (again_prompt, again)]:
        ref = hf_greedy(hf, prompt, new, dev)
        bad = first_mismatch(out.token_ids, ref)
        failed |= bad is not None
        rows.append({"prompt_len": len(prompt), "cached": out.num_cached_tokens,
                     "equal": bad is None, "first_mismatch": bad})  # fmt: skip
    llm.engine.check_integrity()
    stats = llm.engine.stats()
    hit = again.num_cached_tokens
    checks = {
        "prefix_hit_tokens": hit,
        "max_decode_splits": probe.max_splits,
        "kv_blocks_used_after": stats.kv_blocks_used,
    }
    failed |= hit == 0 or stats.kv_blocks_used != 0 or (ctx["cuda"] and probe.max_splits < 2)
    return {"failed": failed, "prompts": rows, **checks}


def _first_step_logits(llm, prompts: list[list[int]]) -> torch.Tensor:
    """The logits the engine sampled its first tokens from (all prompts in one step)."""
    from pdserve.engine import SamplingParams

    model = llm.engine.runner.model
    captured: list[torch.Tensor] = []
    original = model.compute_logits

    def capture(hidden, *plan):  # plan: the step's (engine/step_plan.py)
        logits = original(hidden, *plan)
        captured.append(logits.float().cpu())
        return logits

    model.compute_logits = capture
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    finally:
        model.compute_logits = original
    return captured[0]


def bf16_backends(ctx: dict) -> dict:
    """Triton and torch kernels agree on the first step's logits in bf16."""
    lengths = [17, 300, 1] if ctx["cuda"] else [17, 40, 1]
    prompts = random_prompts(lengths, 512, seed=3)
    name = "hd128_gqa8to2"
    got = {}
    for backend in ("triton", "torch"):
        llm = make_llm(ctx, name, dtype="bfloat16", kernel_backend=backend,
                       max_num_batched_tokens=2048)  # fmt: skip
        got[backend] = _first_step_logits(llm, prompts)
        del llm
    a, b = got["triton"], got["torch"]
    rel = ((a - b).abs().max() / b.abs().max()).item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
    same_top1 = (a.argmax(-1) == b.argmax(-1)).tolist()
    return {"failed": rel > 0.05 or cos < 0.999, "max_rel_err": rel, "min_cosine": cos,
            "same_argmax": same_top1, "rows": len(prompts)}  # fmt: skip


def seeded(ctx: dict) -> dict:
    """Seeded sampling on the device: reproducible alone and in a batch, seed-dependent."""
    from pdserve.engine import SamplingParams

    llm = make_llm(ctx, "hd64_gqa9to3", kernel_backend="triton")  # dtype: the default
    prompt = random_prompts([20], 512, seed=4)[0]
    n = 12 if ctx["cuda"] else 4
    sp = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234, max_tokens=n,
                        ignore_eos=True)  # fmt: skip
    alone = llm.generate([prompt], sp)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=3) for i in range(2)]
    batch = llm.generate([prompt, *random_prompts([5, 9], 512, seed=5)], [sp, *others])
    other = llm.generate([prompt], SamplingParams(temperature=0.8, seed=99, max_tokens=n,
                                                  ignore_eos=True))[0].token_ids  # fmt: skip
    dtype = str(llm.engine.runner.dtype)
    want_dtype = "torch.bfloat16" if ctx["cuda"] else "torch.float32"
    return {
        "failed": alone != batch[0].token_ids or alone == other or dtype != want_dtype,
        "reproducible_in_batch": alone == batch[0].token_ids,
        "seed_changes_tokens": alone != other,
        "default_dtype": dtype,
    }


def load_memory(ctx: dict) -> dict:
    """Peak GPU memory while building and loading a bf16 model vs its weights' size."""
    if not ctx["cuda"]:
        raise Skip("dry run: needs CUDA memory statistics")
    from pdserve.engine.model_arch import ModelArch
    from pdserve.engine.model_build import build_model
    from pdserve.engine.weights import load_model_weights
    from pdserve.kernels.ops import get_ops

    path = model_dir(ctx, "hd128_gqa8to2")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(ModelArch.from_dir(path), get_ops("triton"), torch.device("cuda"),
                        torch.bfloat16)  # fmt: skip
    load_model_weights(model, path)
    torch.cuda.synchronize()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated() - base
    # fp32 first, then a cast, would peak at >= 3x the bf16 size (fp32 copy + bf16 copy).
    return {"failed": peak > 1.5 * weights, "weights_bytes": weights, "peak_bytes": peak,
            "peak_over_weights": round(peak / weights, 3)}  # fmt: skip


def second_gpu(ctx: dict) -> dict:
    """device cuda:1 runs its kernels on GPU 1 and gives GPU 0's tokens."""
    if not ctx["cuda"]:
        raise Skip("dry run: needs two GPUs")
    if torch.cuda.device_count() < 2:
        raise Skip(f"this machine has {torch.cuda.device_count()} GPU: cuda:1 not checkable")
    from pdserve.engine import LLM, SamplingParams

    path = model_dir(ctx, "hd64_gqa9to3")
    prompts = random_prompts([17, 300], 2048, seed=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    toks = {}
    for dev in ("cuda:0", "cuda:1"):
        llm = LLM(path, device=dev, dtype="float32", block_size=16, num_blocks=256)
        toks[dev] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.runner.kv_cache.device == torch.device(dev)
    return {"failed": toks["cuda:0"] != toks["cuda:1"], "equal": toks["cuda:0"] == toks["cuda:1"]}

"""gpu_check section: tensor parallelism inside a node (engine/tp_runner.py).

`engine_tp2`: a tiny random Llama (GQA 8:2) served by one node of two ranks, fp32,
greedy tokens equal to transformers' and (on GPUs) to the same node at TP 1, with chunked
prefill, a prefix hit and batched decode; decode tokens/s at TP 1 and TP 2. On a machine with two
or more GPUs the ranks are cuda:0 and cuda:1 over NCCL (Triton kernels); in a dry run they
are two CPU processes over gloo (torch kernels), which checks the script and the path.
"""

from __future__ import annotations

import time

import torch

from benchmarks._gpu_common import Skip, first_mismatch, hf_greedy, random_prompts


def sections(ctx: dict) -> list:
    return [("engine_tp2", lambda: tp2(ctx))]


def tp2(ctx: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from benchmarks._gpu_engine import model_dir
    from pdserve.engine import LLM, SamplingParams

    cuda = ctx["cuda"]
    if cuda and torch.cuda.device_count() < 2:
        raise Skip(f"this machine has {torch.cuda.device_count()} GPU: TP 2 needs two")
    path = model_dir(ctx, "hd128_gqa8to2")
    dev = "cuda:0" if cuda else "cpu"
    vocab = 2048 if cuda else 512
    lengths = [1, 17, 300, 1500] if cuda else [1, 17, 40]
    new = 16 if cuda else 6
    prompts = random_prompts(lengths, vocab, seed=31)
    again = prompts[-1][: len(prompts[-1]) * 3 // 5] + [5, 6, 7]  # a prefix hit
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    kw = dict(device=dev, dtype="float32", block_size=16, num_blocks=512 if cuda else 128)
    kw.update(max_num_batched_tokens=256 if cuda else 32, num_threads=2)
    if cuda:
        kw["kernel_backend"] = "triton"
    toks, rates = {}, {}
    for tp in (1, 2) if cuda else (2,):  # dry run: the path only (TP 1 is checked elsewhere)
        llm = LLM(path, tensor_parallel_size=tp, **kw)
        try:
            outs = llm.generate(prompts, params) + llm.generate([again], params)
            toks[tp] = [o.token_ids for o in outs]
            hit = outs[-1].num_cached_tokens
            batch = random_prompts([8] * 16, vocab, seed=tp)
            decode = SamplingParams(temperature=0, max_tokens=32 if cuda else 8, ignore_eos=True)
            t0 = time.perf_counter()
            n = sum(len(o.token_ids) for o in llm.generate(batch, decode))
            rates[tp] = round(n / (time.perf_counter() - t0), 1)
            llm.engine.check_integrity()
        finally:
            close = getattr(llm.engine.runner, "close", None)
            if close is not None:
                close()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    rows, failed = [], hit == 0
    for prompt, got, base in zip([*prompts, again], toks[2], toks.get(1, toks[2])):
        bad = first_mismatch(got, hf_greedy(hf, prompt, new, dev))
        failed |= bad is not None or got != base
        rows.append({"prompt_len": len(prompt), "equal_hf": bad is None, "equal_tp1": got == base})
    backend = "nccl" if cuda else "gloo"
    return {"failed": failed, "backend": backend, "prompts": rows, "prefix_hit_tokens": hit,
            "decode_tok_s": {f"tp{k}": v for k, v in rates.items()}}  # fmt: skip

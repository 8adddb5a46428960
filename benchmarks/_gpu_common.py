"""Helpers shared by the sections of benchmarks/gpu_check.py."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch


class Skip(Exception):
    """A section that cannot run here; the message says exactly why."""


def time_ms(fn: Callable[[], object], cuda: bool) -> float:
    """Median milliseconds per call: CUDA events via do_bench on GPU, wall clock on CPU."""
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()  # compile / warm
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1] * 1e3


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def tiny_llama(path: str, *, hidden: int, heads: int, kv_heads: int, vocab: int,
               max_pos: int, seed: int = 0) -> str:  # fmt: skip
    """A random-weight Llama written on the spot (HF format), head_dim = hidden / heads."""
    from tests.conftest import make_tiny_llama

    return make_tiny_llama(
        path,
        seed=seed,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
    )


def hf_greedy(model, prompt: list[int], max_new_tokens: int, device: str) -> list[int]:
    """transformers' greedy continuation, on `device`, ignoring EOS."""
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))

"""The engine's greedy tokens through the Triton kernels equal those through the torch ones.

Runs on the tiny random Llama (head_dim 16, GQA 4:2). Without CUDA the Triton kernels run
under the interpreter. A block size of 4 and a small token budget make prompts span
several blocks and arrive in chunks, so prefill attention sees a cached prefix, and every
generated token after the first goes through paged decode attention.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated
pytest.importorskip("triton")

from pdserve.engine import LLM, SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [
    [1, 5, 7, 9, 11],
    [1, *range(20, 57)],  # 38 tokens: several chunks of the 16-token budget
    [1, 300, 301],
    list(range(100, 119)),
]


def greedy_tokens(
    model_dir: str, backend: str, prompts: list[list[int]], kv_layout: str = "layer_major"
) -> list[list[int]]:
    llm = LLM(
        model_dir,
        device=DEVICE,
        dtype="float32",  # token-exact comparison (the CUDA default is bfloat16)
        kernel_backend=backend,
        block_size=4,
        num_blocks=96,
        max_num_batched_tokens=16,
        kv_layout=kv_layout,
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    # A second round shares the first prompt's blocks: prefill over a prefix-cache hit.
    (again,) = llm.generate([prompts[1] + [42, 43]], params)
    assert again.num_cached_tokens == 36  # 9 full blocks of 4
    llm.engine.check_integrity()
    return [*outs, again.token_ids]
    return outs


def test_triton_backend_matches_torch_backend_greedy(tiny_llama_dir):
    expected = greedy_tokens(tiny_llama_dir, "torch", PROMPTS)
    actual = greedy_tokens(tiny_llama_dir, "triton", PROMPTS)
    assert all(len(t) == 8 for t in expected)
    assert actual == expected


def test_triton_backend_on_a_block_major_cache(tiny_llama_dir):
    """Strided block views (engine/kv_tensor.py): the same tokens as layer-major torch."""
    expected = greedy_tokens(tiny_llama_dir, "torch", PROMPTS[:2])
    assert greedy_tokens(tiny_llama_dir, "triton", PROMPTS[:2], "block_major") == expected

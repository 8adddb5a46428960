"""Shared fixtures: tiny random-weight Llama models for fast tests."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Engines here barely touch their KV cache: faulting all of it in at each start
# (cache.kv_populate) would cost seconds per engine in a VM. tests/test_hugepages.py turns
# it back on where it tests it.
os.environ.setdefault("PDSERVE_KV_POPULATE", "0")


def skip_in_isa_view() -> None:
    """For a test that builds another CPU's kernels and runs them in a child process: under
    scripts/avx2_view.sh only the test process is emulated (the child would run natively,
    repeating what the main suite runs), so it is skipped there."""
    if os.environ.get("PDSERVE_ISA_VIEW"):
        pytest.skip("a native child process: the main suite runs it")


def make_tiny_llama(path: str, *, seed: int = 0, **overrides) -> str:
    """Write a random-weight Llama (HF format, safetensors, no tokenizer) to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    # Larger weights than the default init give peaked logits, so greedy choices are
    # stable against float noise (top-1/top-2 gaps well above 1e-2).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama with GQA (4 query heads, 2 KV heads) and tied embeddings."""
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture
def redis_server():
    """A real redis-server on a free loopback port, stopped after the test."""
    from pdserve.cluster.embedded_redis import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server

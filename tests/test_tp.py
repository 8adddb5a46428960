"""Tensor parallelism inside a node (engine/tp_runner.py, engine/tp_shard.py): N ranks on
CPU over gloo, greedy output token for token equal to transformers."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from pdserve.common.errors import ConfigError
from pdserve.engine import tp_runner
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from tests.conftest import make_tiny_llama
from tests.hf_reference import hf_greedy, load_hf

COLLECTIVE_S = 8.0  # rank 0's collective timeout in these tests (the default is 120 s)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 1000 + 3 for i in range(n)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# num_key_value_heads 4 > 2 ranks (sharded), 1 < 2 ranks (replicated); an odd vocab
# (1023) leaves the last rank's vocab shard padded.
@pytest.fixture(scope="module", params=[4, 1], ids=["kv4", "kv1"])
def tp_llm(request, tmp_path_factory):
    kv = request.param
    path = make_tiny_llama(
        str(tmp_path_factory.mktemp(f"tp_kv{kv}")),
        num_key_value_heads=kv,
        vocab_size=1023,
        num_attention_heads=4,
    )
    # 40 blocks of 4 tokens: four 30-token prompts growing by 12 do not all fit (preemption)
    timeout, tp_runner.COLLECTIVE_TIMEOUT_S = tp_runner.COLLECTIVE_TIMEOUT_S, COLLECTIVE_S
    try:
        llm = LLM(
            path,
            block_size=4,
            num_blocks=40,
            max_num_batched_tokens=32,
            max_num_seqs=8,
            tensor_parallel_size=2,
            num_threads=2,
        )
    finally:
        tp_runner.COLLECTIVE_TIMEOUT_S = timeout
    yield llm, load_hf(path), kv
    pids = llm.engine.runner.worker_pids
    llm.engine.runner.close()
    assert not any(_alive(p) for p in pids)


def test_tp2_greedy_equals_hf_single_batched_chunked_prefix_preempted(tp_llm):
    llm, hf, kv = tp_llm
    runner = llm.engine.runner
    # sharded by KV heads: 4 heads -> 2 per rank; 1 head -> replicated on both ranks
    assert runner.kv_cache.shape[-2] == max(1, kv // 2)
    assert len(runner.worker_pids) == 1 and all(map(_alive, runner.worker_pids))
    # single, with a 70-token prompt prefilled in chunks of 32
    long = _prompt(70, 1)
    (out,) = llm.generate([long], GREEDY)
    assert out.token_ids == hf_greedy(hf, long, 12)
    # prefix hit: the same first 64 tokens are cached
    hits = llm.engine.kv.prefix_hits
    longer = long[:64] + _prompt(6, 2)
    (out,) = llm.generate([longer], GREEDY)
    assert llm.engine.kv.prefix_hits - hits >= 60
    assert out.token_ids == hf_greedy(hf, longer, 12)
    # batched, and more than the pool holds at once: some are preempted and recomputed
    prompts = [_prompt(30, s) for s in range(3, 7)] + [[1, 5, 9]]
    preempted = llm.engine.scheduler.num_preemptions
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > preempted
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 12), f"prompt {prompt[:3]}"
    llm.engine.check_integrity()


def test_a_hung_worker_fails_the_step_after_the_collective_timeout(tp_llm):
    llm, _, kv = tp_llm
    if kv != 1:
        pytest.skip("once is enough (it ends the engine)")
    (worker,) = llm.engine.runner.worker_pids
    os.kill(worker, signal.SIGSTOP)  # alive, its sockets open, silent
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate([[1, 2, 3]], GREEDY)
        waited = time.monotonic() - t0
        assert COLLECTIVE_S - 1 <= waited <= COLLECTIVE_S + 30, waited
    finally:
        os.kill(worker, signal.SIGKILL)


def test_tp_default_model_three_ranks_equals_hf():
    """SmolLM2-135M: 9 heads, 3 KV heads: TP 3 shards it, TP 2 is refused by name."""
    with pytest.raises(ConfigError) as err:
        LLM(tensor_parallel_size=2, num_blocks=16)
    assert err.value.field == "tensor_parallel_size" and "9 attention heads" in str(err.value)
    llm = LLM(tensor_parallel_size=3, num_blocks=64, max_num_batched_tokens=48, num_threads=2)
    try:
        hf = load_hf(llm.engine.model_dir)
        prompts = [_prompt(60, 1)[:60], [1, 2, 3, 4, 5]]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for prompt, out in zip(prompts, llm.generate(prompts, params)):
            assert out.token_ids == hf_greedy(hf, prompt, 6)
    finally:
        llm.engine.runner.close()


def test_tensor_parallel_size_from_flag_refused_in_yaml_and_ray_reservation(tmp_path):
    import argparse

    from pdserve.cluster.config_file import ConfigFileError, load_config
    from pdserve.cluster.ray_launcher import ray_options
    from pdserve.cluster.schema import NodeGroup
    from pdserve.node.cli import add_arguments, engine_config_from_args, resolve_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def engine_config(argv):
        return engine_config_from_args(resolve_settings(parser.parse_args(argv)))

    assert engine_config(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    assert engine_config([]).tensor_parallel_size == 1
    with pytest.raises(ConfigError) as err:
        engine_config(["--tensor-parallel-size", "0"])
    assert err.value.field == "tensor_parallel_size"
    # a PD group of TP 2 on CPU over NIXL loads; on CUDA or over LMCache it is refused
    path = tmp_path / "tp.yaml"
    base = (
        "model: {name: smollm2-135m-instruct}\nrouter: {port: 9000}\n"
        "prefill: {port: 9101, kv_port: 9201, connector: {kind: %s}}\n"
        "decode: {port: 9301, tensor_parallel_size: 2, connector: {kind: %s}%s}\n"
        "redis: embedded\n"
    )
    path.write_text(base % ("nixl", "nixl", ""))
    assert load_config(path).decode.tensor_parallel_size == 2
    path.write_text(base % ("nixl", "nixl", ", device: cuda:0"))
    with pytest.raises(ConfigFileError, match="decode.tensor_parallel_size"):
        load_config(path)
    path.write_text(base % ("lmcache", "lmcache", ""))
    with pytest.raises(ConfigFileError, match="decode.connector.kind"):
        load_config(path)
    # the Ray launcher reserves a CPU per rank of a CPU node, a GPU per rank of a CUDA one
    cpu = ray_options(NodeGroup(port=1, tensor_parallel_size=3))
    gpu = ray_options(
        NodeGroup(port=1, tensor_parallel_size=2, device="cuda:0", ray={"num_cpus": 4})
    )
    assert (cpu["num_cpus"], cpu["num_gpus"]) == (3, 0)
    assert (gpu["num_cpus"], gpu["num_gpus"]) == (4, 2)


def test_tp2_in_bfloat16_follows_tp1(tmp_path):
    """bf16 on CPU: each rank's partial o_proj / down_proj outputs are summed by an
    all-reduce in bf16 where one device sums inside its GEMM, so greedy paths of a random
    model (small logit gaps) may part. Teacher-forced instead: over the same sequences
    (each prompt and TP 1's greedy continuation) every position's logprob of its token
    under TP 2 stays within 0.1 of TP 1's, and so does the top-1 token where TP 1's lead
    over the runner-up is above 0.1."""
    path = make_tiny_llama(str(tmp_path / "bf16"))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    prompts = [_prompt(40, 3), _prompt(9, 4), [1, 5, 9]]
    one = LLM(path, dtype="bfloat16", num_blocks=64, num_threads=2)
    seqs = [p + o.token_ids for p, o in zip(prompts, one.generate(prompts, greedy))]
    ref = one.generate(seqs, score)
    tp = LLM(path, dtype="bfloat16", num_blocks=64, num_threads=2, tensor_parallel_size=2)
    try:
        assert tp.engine.runner.kv_cache.dtype == torch.bfloat16
        got = tp.generate(seqs, score)
    finally:
        tp.engine.runner.close()
    checked = 0
    for a, b in zip(ref, got):
        for x, y in zip(a.prompt_logprobs, b.prompt_logprobs, strict=True):
            assert abs(x.logprobs[0] - y.logprobs[0]) < 0.1, (x, y)
            top = x.logprobs[1:]
            if len(top) >= 2 and top[0] - top[1] > 0.1:
                assert x.token_ids[1] == y.token_ids[1], (x, y)
                checked += 1
    assert checked > 10

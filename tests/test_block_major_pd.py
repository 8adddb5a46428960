"""PD over real NIXL with block-major KV caches (`model.kv_layout: block_major`) on both nodes.

The transport describes each engine's real cache (kv_transfer/kv_layout.py): a run of
blocks over every layer is then one descriptor. Checked: greedy tokens equal Hugging Face
(in process) and the colocated engine (across processes, over HTTP); the same bytes cross
in fewer descriptors than between layer-major caches; a prefill and a decode node whose
layouts differ never exchange a block: the prefill node refuses the decode node's hello
and the request ends with an error naming the mismatch.
"""

from __future__ import annotations

import httpx
import pytest

from pdserve.engine.kv_tensor import BLOCK_MAJOR, LAYER_MAJOR
from tests.hf_reference import hf_greedy, load_hf
from tests.servers import free_port, kill_server, start_server, wait_idle
from tests.test_pd_engine import GREEDY, Pair, prompts_of, tokens

pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


def run_pair(tiny_llama_dir, layout: str, prompts) -> tuple[list, int, int]:
    """Tokens per prompt, bytes and descriptors the prefill node WROTE."""
    pair = Pair(tiny_llama_dir, layouts=(layout, layout))
    try:
        assert pair.pconn.data.layout.block_major == (layout == BLOCK_MAJOR)
        assert pair.dconn.data.layout.block_major == (layout == BLOCK_MAJOR)
        results = [tokens(outs) for outs in pair.run(prompts, GREEDY)]
        assert pair.drole.num_remote_prefills == len(prompts)
        for core in (pair.decode, pair.prefill):
            core.check_integrity()
            assert core.kv.pool.num_used_blocks == 0
        stats = pair.pconn.data.stats
        return results, stats.bytes, stats.descriptors
    finally:
        pair.close()


def test_block_major_pd_equals_hf_in_fewer_descriptors(tiny_llama_dir, hf_model):
    prompts = prompts_of([9, 40, 77, 130], seed=1)
    bm, bm_bytes, bm_descs = run_pair(tiny_llama_dir, BLOCK_MAJOR, prompts)
    for p, got in zip(prompts, bm):
        assert got == hf_greedy(hf_model, p, 8)
    lm, lm_bytes, lm_descs = run_pair(tiny_llama_dir, LAYER_MAJOR, prompts)
    assert lm == bm
    assert bm_bytes == lm_bytes > 0
    # 2 layers: a layer-major run costs 2 * 2 descriptors, a block-major run one. How the
    # prompts' blocks fall into runs depends on when each chunk's WRITE is posted, which
    # differs between the two runs, so only the bound is exact.
    assert bm_descs * 2 <= lm_descs, (bm_descs, lm_descs)


def test_layout_mismatch_is_refused_with_a_clear_error(tiny_llama_dir):
    pair = Pair(tiny_llama_dir, prefill_locally=False, layouts=(LAYER_MAJOR, BLOCK_MAJOR))
    try:
        (outs,) = pair.run(prompts_of([30], seed=5), GREEDY)
        assert outs[-1].finish_reason == "error"
        err = outs[-1].error
        assert "incompatible KV layouts (block_major: ours False, peer's True" in err, err
        assert "same cache.kv_layout (--kv-layout)" in err
        assert pair.pconn.data.stats.bytes == 0 and pair.pconn.data.peers == []
        for core in (pair.decode, pair.prefill):
            core.check_integrity()
            assert core.kv.pool.num_used_blocks == 0
    finally:
        pair.close()


# ---------------------------------------------------------------- across processes (HTTP)


def node_args(model: str, layout: str) -> list[str]:
    return ["--model", model, "--num-blocks", "128", "--num-threads", "1",
            "--log-level", "warning", "--kv-layout", layout]  # fmt: skip


def completion_tokens(url: str, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    toks = r.json()["choices"][0]["logprobs"]["tokens"]  # "token_id:N": no tokenizer
    return [int(t.removeprefix("token_id:")) for t in toks]


@pytest.mark.slow
def test_1p1d_nodes_on_block_major_equal_colocated(tiny_llama_dir):
    from pdserve.engine import LLM

    ctl = f"tcp://127.0.0.1:{free_port()}"
    args = node_args(tiny_llama_dir, BLOCK_MAJOR)
    procs = []
    try:
        _, p = start_server([*args, "--role", "prefill", "--kv-control", ctl])
        procs.append(p)
        decode_url, d = start_server(
            [*args, "--role", "decode", "--prefill-node", ctl, "--kv-transfer-timeout", "120"]
        )
        procs.append(d)
        prompts = prompts_of([70, 150], seed=11)  # longer than local_prefill_max_tokens
        colocated = LLM(tiny_llama_dir, num_blocks=128).generate(prompts, GREEDY)
        for p_ids, ref in zip(prompts, colocated):
            assert completion_tokens(decode_url, p_ids) == ref.token_ids
        stats = wait_idle(decode_url)
        assert stats["pd_remote_prefills"] == 2 and stats["pd_failures"] == 0
        # A layer-major decode node on the same block-major prefill node: refused.
        other_url, o = start_server(
            [
                *node_args(tiny_llama_dir, LAYER_MAJOR),
                "--role",
                "decode",
                "--prefill-node",
                ctl,
                "--on-prefill-failure",
                "error",
            ]  # fmt: skip
        )
        procs.append(o)
        body = {"prompt": prompts[0], "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{other_url}/v1/completions", json=body, timeout=300)
        assert r.status_code >= 500 and "incompatible KV layouts" in r.text, r.text
    finally:
        for p in procs:
            kill_server(p)

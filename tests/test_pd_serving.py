"""The PD path across processes: a prefill node and a decode node (real SmolLM2, real NIXL
agents, real HTTP), checked against the offline colocated engine and Hugging Face.

Nodes: one prefill node (`--role prefill`), one decode node serving the OpenAI API with
that prefill node configured, so every request takes the PD path; the failure test starts
its own short-lived prefill node and kills it mid-prefill.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, load_hf
from tests.servers import (
    engine_state,
    free_port,
    kill_server,
    launch_server,
    start_server,
    wait_healthy,
    wait_idle,
)

pytestmark = pytest.mark.slow
pytest.importorskip("nixl")

MODEL = "smollm2-135m-instruct"
KV_BYTES = 128 << 20
COMMON = [
    "--model",
    MODEL,
    "--kv-cache-bytes",
    str(KV_BYTES),
    "--num-threads",
    "1",
    "--log-level",
    "warning",
]
# Prefill in 64-token chunks, so long prompts push blocks while later chunks compute.
PREFILL_ARGS = [*COMMON, "--max-num-batched-tokens", "64"]


def control_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def prefill_node():
    ctl = control_address()
    url, proc = start_server([*PREFILL_ARGS, "--role", "prefill", "--kv-control", ctl])
    yield url, ctl
    kill_server(proc)


@pytest.fixture(scope="module")
def decode_url(prefill_node):
    _, ctl = prefill_node
    url, proc = start_server(
        [*COMMON, "--role", "decode", "--prefill-node", ctl, "--kv-transfer-timeout", "120"]
    )
    yield url
    kill_server(proc)


@pytest.fixture(scope="module")
def offline():
    from pdserve.engine import LLM

    return LLM(MODEL, kv_cache_bytes=KV_BYTES, num_threads=1)


def complete(url: str, prompt: list[int], max_tokens: int = 16, **extra) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def text_prompt(offline, text: str) -> list[int]:
    return offline.tokenizer.encode(text, add_special_tokens=False)


LONG_TEXT = " ".join(
    f"Item {i}: the {c} box on shelf {i % 7} holds {i * 3} marbles." for i, c in
    zip(range(40), ["red", "blue", "green", "white", "black"] * 8)
)  # fmt: skip


def test_pd_equals_colocated_and_hf(decode_url, offline):
    prompts = [
        offline.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
            tokenize=False,
        ),
        LONG_TEXT,  # ~600 tokens: many 64-token chunks and 16-token blocks
    ]
    ids = [text_prompt(offline, p) for p in prompts]
    assert len(ids[1]) > 500
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    refs = [o.token_ids for o in offline.generate(ids, params)]
    hf = load_hf(offline.engine.model_dir)
    for p, ref in zip(ids, refs):
        assert hf_greedy(hf, p, 16) == ref
    for p, ref in zip(ids, refs):
        out = complete(decode_url, p, logprobs=0)
        got = offline.tokenizer.encode(out["choices"][0]["text"], add_special_tokens=False)
        assert out["choices"][0]["text"] == offline.tokenizer.decode(ref, skip_special_tokens=True)
        assert len(out["choices"][0]["logprobs"]["token_logprobs"]) == 16, got
        assert out["pdserve_timings"]["prefill"] == "remote"  # issue 30: no silent recompute
    stats = wait_idle(decode_url)
    assert stats["pd_remote_prefills"] >= 2 and stats["pd_failures"] == 0
    assert stats["kv_checksum_mismatches"] == 0  # every block checksummed (the default)
    metrics = httpx.get(f"{decode_url}/metrics", timeout=10).text
    assert 'pdserve_prefill_path_total{path="local_transfer_failed"} 0.0' in metrics
    assert (
        f'pdserve_prefill_path_total{{path="remote"}} {stats["prefill_paths"]["remote"]}.0'
        in metrics
    )


def test_chat_through_pd(decode_url):
    r = httpx.post(
        f"{decode_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 20,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."


@pytest.mark.parametrize("asked", ["tcp://nohost:1", "ipc:///tmp/elsewhere", "tcp://127.0.0.1:1"])
def test_client_cannot_choose_the_prefill_node(decode_url, prefill_node, offline, asked):
    """Used to be accepted: the engine connected there (tcp://nohost killed it)."""
    body = {"prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"prefill_node": asked}}
    r = httpx.post(f"{decode_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params.prefill_node" and "not one of" in err["message"]
    assert httpx.get(f"{decode_url}/health", timeout=30).status_code == 200
    prompt = text_prompt(offline, LONG_TEXT)[:100]
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    out = complete(decode_url, prompt, 4, kv_transfer_params={"prefill_node": prefill_node[1]})
    assert out["choices"][0]["text"] == ref[0].text  # the configured node is honoured


def test_16_concurrent_requests(decode_url, prefill_node, offline):
    words = ["apple", "river", "mountain", "violin", "planet", "garden", "bridge", "winter"]
    prompts = [
        text_prompt(
            offline, f"Write a short story about a {words[i % 8]} and number {i}. " * (1 + i % 5)
        )
        for i in range(16)
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    refs = [
        offline.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        for o in offline.generate(prompts, params)
    ]

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:

            async def one(p):
                body = {"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
                r = await c.post(f"{decode_url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == refs
    wait_idle(decode_url)
    wait_idle(prefill_node[0])  # the prefill node keeps nothing but prefix cache


def test_only_uncached_blocks_cross(decode_url, offline):
    base = text_prompt(offline, LONG_TEXT)[:320]  # 20 full blocks
    complete(decode_url, base + text_prompt(offline, " The first shelf"), max_tokens=4)
    before = engine_state(decode_url)["kv_bytes_received"]
    tail = text_prompt(
        offline,
        " Now count every marble on shelves two and five, one by one, and then tell me"
        " which colour of box holds the most marbles of all, and why that might be.",
    )
    assert len(tail) > 16  # longer than local_prefill_max_tokens: prefilled remotely
    prompt = base + tail
    out = complete(decode_url, prompt, max_tokens=4)
    after = wait_idle(decode_url)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 320
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # layers x (K,V) x block x kv heads x head dim x fp32
    uncached_blocks = -(-len(prompt) // 16) - 20
    assert after["kv_bytes_received"] - before == uncached_blocks * block_bytes
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[
        0
    ]
    assert out["choices"][0]["text"] == ref.text


@pytest.fixture(scope="module")
def hf(offline):
    return load_hf(offline.engine.model_dir)


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_echo_prompt_logprobs_come_from_the_prefill_node(decode_url, prefill_node, offline, hf):
    """echo + logprobs over PD: the prefill node computes the prompt logprobs in the
    prompt's forward pass (and the first token's top logprobs); equal to the single-node
    engine and to transformers' log-softmax."""
    prefill_url, _ = prefill_node
    ids = text_prompt(offline, LONG_TEXT)[:150]  # 3 prefill chunks of 64 tokens
    before_p, before_d = engine_state(prefill_url), engine_state(decode_url)
    out = complete(decode_url, ids, max_tokens=3, echo=True, logprobs=3)
    after_d, after_p = wait_idle(decode_url), wait_idle(prefill_url)
    assert after_p["pd_orders"] == before_p["pd_orders"] + 1  # the prefill node ran it
    assert after_d["pd_remote_prefills"] == before_d["pd_remote_prefills"] + 1
    assert after_d["pd_failures"] == before_d["pd_failures"]
    lps = out["choices"][0]["logprobs"]
    assert len(lps["tokens"]) == len(ids) + 3 and lps["token_logprobs"][0] is None

    params = SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=3,
        prompt_logprobs=3,
    )  # fmt: skip
    single = offline.generate([ids], params)[0]
    want = [None, *(e.logprobs[0] for e in single.prompt_logprobs), *single.logprobs]
    assert all(abs(a - b) < 1e-4 for a, b in zip(lps["token_logprobs"][1:], want[1:]))
    tok = offline.tokenizer
    tops = [*single.prompt_logprobs, *single.top_logprobs]
    for j, e in enumerate(tops, start=1):
        assert _close(
            lps["top_logprobs"][j], {tok.decode([t]): v for t, v in zip(e.token_ids, e.logprobs)}
        )

    full = ids + single.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full[:-1]])).logits[0].float(), dim=-1)
    for j in range(1, len(full)):
        assert abs(lps["token_logprobs"][j] - ref[j - 1, full[j]].item()) < 1e-4, j
    first = len(ids)  # the first token, sampled on the prefill node: its top 3
    top = ref[first - 1].topk(3)
    want_top = {tok.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
    assert _close(lps["top_logprobs"][first], want_top)  # greedy: the token is the top 1


@pytest.mark.parametrize("stream", [False, True])
def test_first_token_top_logprobs_over_pd(decode_url, prefill_node, offline, hf, stream):
    """Chat top_logprobs over PD, streamed and not: the first token (sampled on the prefill
    node) carries its alternatives like every later one, equal to transformers' top-k."""
    prefill_url, _ = prefill_node
    # a prompt new to the decode node's prefix cache, so it is prefilled remotely
    ask = "Name three colours of the rainbow" + (", quickly." if stream else ", please.")
    msgs = [{"role": "user", "content": ask}]
    prompt = offline.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)[
        "input_ids"
    ]
    orders = engine_state(prefill_url)["pd_orders"]
    body = {
        "messages": msgs, "max_tokens": 4, "temperature": 0, "logprobs": True,
        "top_logprobs": 5, "stream": stream,
    }  # fmt: skip
    r = httpx.post(f"{decode_url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        content = [t for e in events if e["choices"] and e["choices"][0].get("logprobs")
                   for t in e["choices"][0]["logprobs"]["content"]]  # fmt: skip
    else:
        content = r.json()["choices"][0]["logprobs"]["content"]
    assert wait_idle(prefill_url)["pd_orders"] == orders + 1
    out = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    assert len(content) == len(out) == 4
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out[:-1]])).logits[0].float(), dim=-1)
    for j, t in enumerate(content):
        top = ref[len(prompt) - 1 + j].topk(5)
        assert [a["token"] for a in t["top_logprobs"]] == [
            offline.tokenizer.decode([i]) for i in top.indices.tolist()
        ], j
        assert (
            max(abs(a["logprob"] - v) for a, v in zip(t["top_logprobs"], top.values.tolist()))
            < 1e-4
        )
        assert abs(t["logprob"] - ref[len(prompt) - 1 + j, out[j]].item()) < 1e-4


def test_client_abort_frees_both_nodes(decode_url, prefill_node, offline):
    prefill_url, _ = prefill_node
    prompt = text_prompt(offline, LONG_TEXT)  # long enough that prefill takes a while

    async def start_then_disconnect():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"prompt": prompt + [13], "max_tokens": 50, "temperature": 0, "stream": True}
            async with c.stream("POST", f"{decode_url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                await asyncio.sleep(0.3)  # the prefill node is now computing chunks
            # leaving the block closes the connection: the decode node aborts

    asyncio.run(start_then_disconnect())
    wait_idle(decode_url, timeout_s=60)
    stats = wait_idle(prefill_url, timeout_s=60)
    assert stats["kv_blocks_held"] == 0


def test_prefill_node_killed_mid_prefill(offline):
    """The prefill process dies mid-prefill: decode notices the missed heartbeats and
    prefills locally at once, long before the transfer deadline; the failed attempt's
    blocks stay held (a WRITE could still land) until its connection is fenced and the
    last lease granted on it ran out (2 s x 1.02 + 1 s grace), not until the deadline."""
    ctl = control_address()
    purl, pproc = launch_server(
        [*PREFILL_ARGS, "--max-num-batched-tokens", "16", "--role", "prefill", "--kv-control", ctl],
        free_port(),
    )
    durl, dproc = launch_server(
        [
            *COMMON,
            "--role",
            "decode",
            "--prefill-node",
            ctl,
            "--kv-transfer-timeout",
            "40",
            "--kv-peer-timeout",
            "2",
            "--kv-abort-grace",
            "1",
        ],
        free_port(),
    )
    try:
        wait_healthy(purl, pproc)
        wait_healthy(durl, dproc)
        prompt = text_prompt(offline, LONG_TEXT)
        ref = offline.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )[0]

        async def run():
            async with httpx.AsyncClient(timeout=300) as c:
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                task = asyncio.create_task(c.post(f"{durl}/v1/completions", json=body))
                deadline = time.monotonic() + 30
                while engine_state(purl)["num_running"] == 0:  # wait until prefill is computing
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                os.kill(pproc.pid, signal.SIGKILL)
                t0 = t_kill[0] = time.monotonic()
                r = await task
                return r, time.monotonic() - t0

        t_kill = [0.0]
        r, waited = asyncio.run(run())
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.text  # prefilled locally, same tokens
        assert r.json()["pdserve_timings"]["prefill"] == "local_transfer_failed"  # and says so
        assert waited < 40  # failed over on peer death, not at the 40 s deadline
        stats = wait_idle(durl, timeout_s=100)  # released once the fence's lease ran out
        released = time.monotonic() - t_kill[0]
        assert stats["pd_failures"] == 1 and stats["kv_blocks_held"] == 0
        assert released < 40, released  # not held to the transfer deadline
    finally:
        kill_server(pproc)
        kill_server(dproc)

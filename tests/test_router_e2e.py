"""The `openai` client, unmodified, through the router over 1 prefill + 1 decode node of the
real SmolLM2 (real NIXL, real Redis registry): greedy output equals a colocated node's and
Hugging Face's, for chat and completions, streamed and not.
"""

from __future__ import annotations

import pytest

from cluster.embedded_redis import EmbeddedRedis
from tests.hf_reference import hf_greedy, load_hf
from tests.servers import free_port, kill_server, launch_server, start_server, wait_healthy

pytestmark = pytest.mark.slow
pytest.importorskip("nixl")
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
COMMON = ["--model", MODEL, "--kv-cache-bytes", str(64 << 20), "--num-threads", "1",
          "--log-level", "warning", "--heartbeat-s", "0.5"]  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster():
    with EmbeddedRedis() as redis:
        ctl = f"tcp://127.0.0.1:{free_port()}"
        procs = []
        try:
            p = launch_server([*COMMON, "--role", "prefill", "--kv-control", ctl,
                               "--redis-url", redis.url], free_port())  # fmt: skip
            d = launch_server([*COMMON, "--role", "decode", "--redis-url", redis.url], free_port())
            c = launch_server(COMMON, free_port())  # colocated, not in the cluster
            procs = [p[1], d[1], c[1]]
            for url, proc in (p, d, c):
                wait_healthy(url, proc)
            router, rproc = start_server(
                ["--model", MODEL, "--redis-url", redis.url, "--log-level", "warning"],
                command="router",
            )
            procs.append(rproc)
            yield router, c[0]
        finally:
            for proc in procs:
                kill_server(proc)


def test_openai_client_through_router_equals_colocated_and_hf(cluster):
    import time

    import httpx

    router, colocated = cluster
    deadline = time.monotonic() + 60
    while True:  # the decode node allows the prefill node from its next heartbeat on
        nodes = httpx.get(f"{router}/cluster", timeout=10).json()["nodes"]
        if sum(n["in_registry"] for n in nodes) == 2:
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1.0)
    via = openai.OpenAI(base_url=f"{router}/v1", api_key="unused")
    direct = openai.OpenAI(base_url=f"{colocated}/v1", api_key="unused")
    args = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    routed = via.chat.completions.create(**args)
    local = direct.chat.completions.create(**args)
    assert routed.choices[0].message.content == local.choices[0].message.content
    assert routed.choices[0].message.content == "The capital of France is Paris."
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in via.chat.completions.create(**args, stream=True)
        if c.choices
    )
    assert streamed == routed.choices[0].message.content

    prompt = "The three primary colours are"
    comp = via.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                  logprobs=0)  # fmt: skip
    comp_local = direct.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, logprobs=0
    )
    assert comp.choices[0].text == comp_local.choices[0].text
    # Hugging Face's greedy continuation of the same prompt ids, token for token
    from engine.model_files import resolve_model
    from engine.tokenizer import load_tokenizer

    model_dir = resolve_model(MODEL)
    tok = load_tokenizer(model_dir)
    ids = tok.encode(prompt, add_special_tokens=False)
    ref = hf_greedy(load_hf(model_dir), ids, 12, stop_at_eos=True)
    assert comp.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    stats = httpx.get(f"{router}/metrics", timeout=10).text
    assert 'pdserve_router_prefills_total{where="remote"}' in stats

"""The `openai` client, unmodified, through the router over 1 prefill + 1 decode node of the
real SmolLM2 (real NIXL, real Redis registry): greedy output equals a colocated node's and
Hugging Face's, for chat and completions, streamed and not.
"""

from __future__ import annotations

import pytest

from pdserve.cluster.embedded_redis import EmbeddedRedis
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
    from pdserve.common.model_files import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    model_dir = resolve_model(MODEL)
    tok = load_tokenizer(model_dir)
    ids = tok.encode(prompt, add_special_tokens=False)
    ref = hf_greedy(load_hf(model_dir), ids, 12, stop_at_eos=True)
    assert comp.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    stats = httpx.get(f"{router}/metrics", timeout=10).text
    assert 'pdserve_router_prefills_total{where="remote"}' in stats


# -- every OpenAI field through the router (batch prompts, n, logprobs, echo, structured) --
def wait_cluster(router: str) -> None:
    import time

    import httpx

    deadline = time.monotonic() + 60
    while (
        sum(n["in_registry"] for n in httpx.get(f"{router}/cluster", timeout=10).json()["nodes"])
        < 2
    ):
        assert time.monotonic() < deadline
        time.sleep(0.2)


def post_both(cluster, path: str, body: dict) -> tuple[dict, dict]:
    import httpx

    router, colocated = cluster
    wait_cluster(router)
    out = []
    for url in (router, colocated):
        r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=300)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out[0], out[1]


def stream_choices(url: str, body: dict) -> tuple[dict[int, str], dict]:
    """Text per choice index and the usage chunk of a streamed completion."""
    import json

    import httpx

    texts: dict[int, str] = {}
    usage = None
    body = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            usage = chunk.get("usage") or usage
    return texts, usage


BATCH = ["The three primary colours are", "A haiku about the sea:", "def fibonacci(n):"]


def test_batch_prompts_through_the_router_equal_the_node(cluster):
    body = {"prompt": BATCH, "max_tokens": 8, "temperature": 0, "n": 2}
    routed, local = post_both(cluster, "/v1/completions", body)
    assert [c["index"] for c in routed["choices"]] == list(range(6))
    assert [c["text"] for c in routed["choices"]] == [c["text"] for c in local["choices"]]
    assert routed["usage"] == local["usage"] and routed["usage"]["completion_tokens"] == 48
    from pdserve.common.model_files import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(MODEL))
    ids = [tok.encode(p, add_special_tokens=False) for p in BATCH]
    by_ids, _ = post_both(cluster, "/v1/completions", {**body, "prompt": ids})
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in local["choices"]]
    router, _ = cluster
    texts, usage = stream_choices(router, body)
    assert [texts[i] for i in range(6)] == [c["text"] for c in local["choices"]]
    assert usage == local["usage"]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_logprobs_batch_through_the_router_equal_the_node(cluster, max_tokens):
    """lm-eval's request through the router (served as a stream from the node, so that
    it migrates: router/buffered.py); the long prompt is prefilled on the prefill node,
    which returns its prompt logprobs. max_tokens 0: the prompt alone."""
    long = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(8))
    body = {"prompt": [long, BATCH[0]], "max_tokens": max_tokens, "echo": True, "logprobs": 2,
            "temperature": 0}  # fmt: skip
    routed, local = post_both(cluster, "/v1/completions", body)
    assert routed["usage"] == local["usage"]
    for a, b in zip(routed["choices"], local["choices"], strict=True):
        la, lb = a["logprobs"], b["logprobs"]
        assert a["text"] == b["text"] and la["tokens"] == lb["tokens"]
        assert la["text_offset"] == lb["text_offset"] and a["finish_reason"] == b["finish_reason"]
        assert la["token_logprobs"][0] is None and lb["token_logprobs"][0] is None
        assert (
            max(abs(x - y) for x, y in zip(la["token_logprobs"][1:], lb["token_logprobs"][1:]))
            < 1e-4
        )
        for ta, tb in zip(la["top_logprobs"][1:], lb["top_logprobs"][1:]):
            assert ta.keys() == tb.keys() and all(abs(ta[k] - tb[k]) < 1e-4 for k in ta)


def test_n_seeded_chat_logprobs_through_the_router(cluster):
    msgs = [{"role": "user", "content": "Hi"}]
    body = {"messages": msgs, "max_tokens": 6, "n": 3, "seed": 11, "temperature": 0.9,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    routed, local = post_both(cluster, "/v1/chat/completions", body)
    assert [c["index"] for c in routed["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in routed["choices"]}) > 1  # seed + i each
    for c in routed["choices"]:
        assert all(len(t["top_logprobs"]) == 2 for t in c["logprobs"]["content"])
    assert routed["usage"] == local["usage"] and routed["usage"]["completion_tokens"] == 18


def test_structured_output_and_tools_through_the_router(cluster):
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    body = {"messages": QUESTION, "max_tokens": 30, "temperature": 0, "response_format": rf}
    routed, local = post_both(cluster, "/v1/chat/completions", body)
    content = routed["choices"][0]["message"]["content"]
    assert content == local["choices"][0]["message"]["content"]
    assert set(json.loads(content)) == {"city"}

    tool = {"type": "function", "function": {"name": "weather", "parameters": schema}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"messages": ask, "max_tokens": 40, "temperature": 0, "tools": [tool],
            "tool_choice": "required"}  # fmt: skip
    routed, local = post_both(cluster, "/v1/chat/completions", body)
    (call,) = routed["choices"][0]["message"]["tool_calls"]
    assert routed["choices"][0]["finish_reason"] == "tool_calls"
    assert routed["choices"][0]["message"]["content"] is None
    assert call["function"]["name"] == "weather" and "city" in json.loads(
        call["function"]["arguments"]
    )
    # the tools reach the template through the router as on a node: the same prompt
    assert routed["usage"]["prompt_tokens"] == local["usage"]["prompt_tokens"]
    auto, auto_local = post_both(cluster, "/v1/chat/completions", {**body, "tool_choice": "auto"})
    assert auto["usage"]["prompt_tokens"] == auto_local["usage"]["prompt_tokens"]

    def reply(r):  # call ids are random: compare what was said and called
        m = r["choices"][0]["message"]
        return m["content"], [c["function"] for c in m.get("tool_calls") or []]

    assert reply(auto) == reply(auto_local)

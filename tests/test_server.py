"""A live node (`python -m pdserve serve`) against the official openai client and raw HTTP.

One server and one offline `LLM` per module (both the real SmolLM2, fp32): every text the
server returns is compared with the offline engine's text for the same greedy request.
The last test SIGTERMs the server and checks that its engine process is gone too.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

from pdserve.engine.sampling_params import SamplingParams
from tests.servers import (
    alive,
    descendants,
    engine_state,
    kill_server,
    start_server,
    wait_idle,
)

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
KV_BYTES = 256 << 20
MAX_BODY = 1 << 20
# One torch thread on each side: the server's engine and this process's offline engine never
# oversubscribe a 2-core CI box, and both compute with the same kernels (same floats).
THREADS = 1


@pytest.fixture(scope="module")
def server():
    url, proc = start_server(
        ["--model", MODEL, "--kv-cache-bytes", str(KV_BYTES), "--max-body-bytes", str(MAX_BODY),
         "--num-threads", str(THREADS), "--log-level", "warning"]
    )  # fmt: skip
    yield url, proc
    kill_server(proc)


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def offline():
    from pdserve.engine import LLM

    return LLM(MODEL, kv_cache_bytes=KV_BYTES, num_threads=THREADS)


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


# -- the openai client, text equality ------------------------------------------------------

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def test_chat_stream_equals_non_stream_equals_offline(client, offline):
    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24))[0]
    full = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)
    assert full.choices[0].message.content == ref.text
    assert full.choices[0].finish_reason == ref.finish_reason
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert full.usage.completion_tokens == len(ref.token_ids)

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0, max_completion_tokens=24, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_completion_stream_equals_non_stream_equals_offline(client, offline):
    prompt = "The three primary colours are"
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert ref.finish_reason == "length"
    full = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=20, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].text == ref.text
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            temperature=0,
            max_tokens=20,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_and_pretokenized_prompts(client, offline):
    prompt = "Count from one to ten in words: one, two, three,"
    params = SamplingParams(temperature=0, max_tokens=30, stop=[" six"])
    ref = offline.generate(prompt, params)[0]
    assert ref.finish_reason == "stop" and "six" not in ref.text
    ids = offline.tokenizer.encode(prompt, add_special_tokens=False)
    for p in (prompt, ids):  # text, and the router's pre-tokenized form
        streamed = list(
            client.completions.create(
                model=MODEL, prompt=p, temperature=0, max_tokens=30, stop=" six", stream=True
            )
        )
        assert "".join(c.choices[0].text for c in streamed) == ref.text
        assert streamed[-1].choices[0].finish_reason == "stop"
    # Chat with the extension field: the prompt is taken as given, messages are ignored.
    chat_ids = offline.tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False
    )
    chat_ids = offline.tokenizer.encode(chat_ids, add_special_tokens=False)
    ref_chat = offline.generate(chat_ids, SamplingParams(temperature=0, max_tokens=12))[0]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "ignored"}], temperature=0, max_tokens=12,
        extra_body={"prompt_token_ids": chat_ids},
    )  # fmt: skip
    assert out.choices[0].message.content == ref_chat.text


def test_seeded_sampling_and_logprobs(client):
    kw = dict(model=MODEL, messages=CHAT, temperature=0.8, top_p=0.9, max_tokens=16, seed=1234)
    a = client.chat.completions.create(**kw, extra_body={"top_k": 40})
    b = client.chat.completions.create(**kw, extra_body={"top_k": 40})
    assert a.choices[0].message.content == b.choices[0].message.content
    lp = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=8, logprobs=True
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == lp.choices[0].message.content


def test_models_health_and_metrics(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{url}/health").status_code == 200
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "pdserve_num_requests_running", "pdserve_num_requests_waiting", "pdserve_kv_blocks_used",
        "pdserve_kv_blocks_total", "pdserve_prefix_cache_hits_total",
        "pdserve_time_to_first_token_seconds_bucket", "pdserve_inter_token_latency_seconds_bucket",
        "pdserve_generation_tokens_total",
    ):  # fmt: skip
        assert name in text


# -- concurrency ---------------------------------------------------------------------------


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_32_concurrent_streams(url, offline):
    prompts = [f"Write one sentence about the number {i}." for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=16)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    refs = [o.text for o in offline.chat(messages, params)]
    # The offline batch equals single-request runs (spot-checked here; the engine tests
    # check batched == Hugging Face token for token).
    for i in (0, 13, 31):
        assert offline.chat(messages[i], params)[0].text == refs[i]

    async def one(http: httpx.AsyncClient, prompt: str) -> str:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": 16,
            "stream": True,
        }
        text, done = "", False
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        assert done
        return text

    async def main() -> tuple[list[str], float]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            peak = 0.0
            tasks = [asyncio.create_task(one(http, p)) for p in prompts]
            while not all(t.done() for t in tasks):
                peak = max(
                    peak, metric((await http.get("/metrics")).text, "pdserve_num_requests_running")
                )
                await asyncio.sleep(0.05)
            return [t.result() for t in tasks], peak

    texts, peak = asyncio.run(main())
    assert texts == refs
    assert peak > 1
    wait_idle(url)


# -- disconnects ---------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_blocks(url, client):
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(l for l in lines if l.startswith("data: "))  # noqa: E741
            assert engine_state(url)["kv_blocks_used"] > 0
        # leaving the block closed the connection mid-stream
    wait_idle(url)
    # Non-streaming: the client gives up (timeout) and the server notices.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=1.5)
    wait_idle(url)
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4


# -- bad input -----------------------------------------------------------------------------

CONTEXT_PROMPT = [100] * 9000  # more than the context (8192, less with this KV budget)

BAD = [
    ("malformed json", "/v1/completions", b'{"prompt": "hi", ', 400, None),
    ("wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("prompt not a string", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("temperature < 0", "/v1/chat/completions", {"messages": CHAT, "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("n > 16", "/v1/completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("token outside vocab", "/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("prompt over context", "/v1/completions", {"prompt": CONTEXT_PROMPT}, 400, "prompt"),
    ("prompt + max_tokens over context", "/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("invalid role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("body over limit", "/v1/completions", {"prompt": "x" * (MAX_BODY + 10)}, 413, None),
    # values that crashed the engine or leaked a request before boundary validation
    ("temperature NaN", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("temperature Infinity", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400, "temperature"),
    ("top_p NaN", "/v1/completions", b'{"prompt": "hi", "top_p": NaN}', 400, "top_p"),
    ("min_p -Infinity", "/v1/completions", b'{"prompt": "hi", "min_p": -Infinity}', 400, "min_p"),
    ("seed beyond int64", "/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("top_k beyond int64", "/v1/completions", {"prompt": "hi", "top_k": 2**63}, 400, "top_k"),
    ("max_tokens beyond int64", "/v1/completions", {"prompt": "hi", "max_tokens": 2**64}, 400, "max_tokens"),
    ("negative token id", "/v1/completions", {"prompt": [1, -1]}, 400, "prompt"),
    ("token id beyond int64", "/v1/completions", {"prompt": [2**70]}, 400, "prompt"),
    ("chat token ids outside vocab", "/v1/chat/completions", {"prompt_token_ids": [10**9]}, 400, "prompt"),
    ("prefill_node on a colocated node", "/v1/completions", {"prompt": "hi", "kv_transfer_params": {"prefill_node": "tcp://nohost:1"}}, 400, "kv_transfer_params.prefill_node"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_input_gets_openai_error(url, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    assert httpx.get(f"{url}/health").status_code == 200


def test_correct_text_after_hostile_values(client, offline):
    """Runs after every hostile request above: the same node still generates exact text,
    and a tiny temperature (which used to crash sampling) is greedy."""
    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=16))[0]
    for temperature in (0, 1e-30):
        out = client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=temperature, max_tokens=16
        )
        assert out.choices[0].message.content == ref.text


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")


def test_health_reports_a_stuck_engine(server, url, client, offline):
    """/health checks the engine loop answers: a stopped engine process is a 503 (it used
    to stay 200 while the engine thread was blocked), and a 200 again once it runs."""
    _, proc = server
    kids = descendants(proc.pid)
    for pid in kids:
        os.kill(pid, signal.SIGSTOP)
    try:
        r = httpx.get(f"{url}/health", timeout=120)  # waits out the 10 s liveness deadline
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unresponsive"
    finally:
        for pid in kids:
            os.kill(pid, signal.SIGCONT)
    assert httpx.get(f"{url}/health", timeout=120).status_code == 200
    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=8))[0]
    out = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=8)
    assert out.choices[0].message.content == ref.text


# -- shutdown (keep last: it stops the module's server) -------------------------------------


def test_sigterm_stops_engine_process(server, url):
    _, proc = server
    kids = descendants(proc.pid)
    assert kids, "the server should have an engine process"
    wait_idle(url)
    proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully (lifespan: the engine is told to stop), then re-raises
    # the signal, so the exit status is either 0 or "killed by SIGTERM".
    assert proc.wait(60) in (0, -signal.SIGTERM)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in kids if alive(p)], "orphan processes after SIGTERM"

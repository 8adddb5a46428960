"""The OpenAI fields real clients send, through a live node (real SmolLM2, fp32): penalties
and logit_bias, logprobs/top_logprobs (streamed and not), echo with prompt logprobs, n,
batch prompts, /tokenize and /detokenize, and strict handling of unknown fields.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from pdserve.engine.sampling_params import SamplingParams
from tests.hf_reference import load_hf
from tests.servers import engine_state, kill_server, start_server, wait_idle

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
KV_BYTES = 128 << 20
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
FRUITS = "A list of fruits: apple, apple, apple,"


@pytest.fixture(scope="module")
def url():
    u, proc = start_server(
        ["--model", MODEL, "--kv-cache-bytes", str(KV_BYTES), "--num-threads", "1",
         "--log-level", "warning"]
    )  # fmt: skip
    yield u
    kill_server(proc)


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    from pdserve.engine import LLM

    return LLM(MODEL, kv_cache_bytes=KV_BYTES, num_threads=1)


@pytest.fixture(scope="module")
def hf(offline):
    return load_hf(offline.engine.model_dir)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


# -- strict fields ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/v1/completions", {"prompt": "hi", "logit_bias_typo": {}}, "logit_bias_typo"),
        ("/v1/chat/completions", {"messages": CHAT, "functions": []}, "functions"),
        ("/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "x"}}, "audio"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, "messages.0.x"),
        ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [99999999]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ("/tokenize", {"prompt": "hi", "messages": CHAT}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)  # fmt: skip
def test_unknown_or_out_of_range_fields_are_400_naming_the_field(url, path, body, field):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_accepted_and_ignored_fields(url, offline):
    ref = offline.generate("Hello", SamplingParams(temperature=0, max_tokens=5))[0]
    body = {"prompt": "Hello", "temperature": 0, "max_tokens": 5, "user": "u1", "store": False}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text


# -- tokenize --------------------------------------------------------------------------


def test_tokenize_and_detokenize(url, offline):
    tok = offline.tokenizer
    r = post(url, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["token_strs"] == [tok.decode([t]) for t in r["tokens"]] and r["max_model_len"] > 0
    r = post(url, "/tokenize", {"messages": CHAT}).json()
    assert (
        r["tokens"]
        == offline.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
    )
    assert post(url, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == tok.decode(
        r["tokens"]
    )


# -- penalties -------------------------------------------------------------------------


def test_penalties_and_bias_equal_the_offline_engine(client, offline):
    kw = dict(
        temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5
    )
    ref = offline.generate(FRUITS, SamplingParams(**kw, repetition_penalty=1.2))[0]
    out = client.completions.create(
        model=MODEL, prompt=FRUITS, temperature=0, max_tokens=12, frequency_penalty=1.5,
        presence_penalty=0.5, extra_body={"ignore_eos": True, "repetition_penalty": 1.2},
    )  # fmt: skip
    assert out.choices[0].text == ref.text
    banana = offline.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = client.completions.create(
        model=MODEL, prompt=FRUITS, temperature=0.7, max_tokens=4, logit_bias={str(banana): 100}
    )
    assert forced.choices[0].text == " banana" * 4


# -- logprobs --------------------------------------------------------------------------


def test_echo_prompt_logprobs_equal_transformers(url, offline, hf):
    ids = offline.tokenizer.encode(
        "The quick brown fox jumps over the lazy dog", add_special_tokens=False
    )
    body = {"prompt": [ids], "max_tokens": 0, "echo": True, "logprobs": 3, "temperature": 0}
    choice = post(url, "/v1/completions", body).json()["choices"][0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    lps = choice["logprobs"]
    assert choice["text"] == offline.tokenizer.decode(ids)
    assert len(lps["tokens"]) == len(ids) and lps["token_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert abs(lps["token_logprobs"][j] - ref[j - 1, ids[j]].item()) < 1e-4
        top = ref[j - 1].topk(3)
        want = {offline.tokenizer.decode([t]) for t in top.indices.tolist()}
        assert want <= set(lps["top_logprobs"][j])
    # lm-eval's shape: echo + max_tokens=1 + logprobs=1, batch of token-id prompts
    body = {
        "prompt": [ids, ids[:5]],
        "max_tokens": 1,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    choices = post(url, "/v1/completions", body).json()["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [len(ids) + 1, 6]
    assert abs(choices[1]["logprobs"]["token_logprobs"][4] - ref[3, ids[4]].item()) < 1e-4


def test_top_logprobs_streamed_equal_non_streamed_equal_transformers(client, offline, hf):
    kw = dict(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=6, logprobs=True, top_logprobs=5
    )
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in full]
    prompt = offline.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)[
        "input_ids"
    ]
    out = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=6))[0]
    with torch.no_grad():
        x = torch.tensor([prompt + out.token_ids[:-1]])
        ref = torch.log_softmax(hf(x).logits[0, len(prompt) - 1 :].float(), dim=-1)
    for j, t in enumerate(full):
        top = ref[j].topk(5)
        assert [a.token for a in t.top_logprobs] == [
            offline.tokenizer.decode([i]) for i in top.indices.tolist()
        ]
        assert max(abs(a.logprob - v) for a, v in zip(t.top_logprobs, top.values.tolist())) < 1e-4


# -- n and batches ---------------------------------------------------------------------


def test_n4_seeded_reproducible_and_prompt_computed_once(url, client):
    prompt = "Write a short poem about the sea. " * 8  # several full blocks
    wait_idle(url)
    before = engine_state(url)
    kw = dict(model=MODEL, prompt=prompt, n=4, seed=7, temperature=1.0, max_tokens=8)
    a = client.completions.create(**kw)
    after = engine_state(url)
    b = client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and len(set(texts)) > 1
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    n_prompt = a.usage.prompt_tokens
    full_blocks = (n_prompt - 1) // 16 * 16
    hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    assert hits >= 3 * full_blocks  # choices 2..4 read choice 1's prompt blocks
    stream = list(client.completions.create(**kw, stream=True))
    joined = [
        "".join(c.choices[0].text for c in stream if c.choices and c.choices[0].index == i)
        for i in range(4)
    ]
    assert joined == texts
    wait_idle(url)


def test_batch_prompts_equal_single_requests(client):
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
    batch = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=6)
    singles = [
        client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=6)
        for p in prompts
    ]
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [
        s.choices[0].text for s in singles
    ]
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_nothing_left_behind(url):
    stats = wait_idle(url)
    assert stats["kv_blocks_used"] == 0
    assert json.dumps(engine_state(url))


# -- structured output -----------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
TOPICS = ["a chef", "a pilot", "a child", "a painter", "a farmer", "a doctor", "a student",
          "a retired teacher", "a musician", "an athlete"]  # fmt: skip


def test_20_json_schema_requests_all_validate(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for i in range(20):
        topic = TOPICS[i % len(TOPICS)]
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Describe {topic} as JSON."}],
            response_format=fmt, max_tokens=120, temperature=0 if i < 10 else 0.9, seed=i,
        )  # fmt: skip
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_json_object_and_bad_schemas(url, client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=80, temperature=0,
    )  # fmt: skip
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    r = post(url, "/v1/chat/completions", {"messages": CHAT, "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("response_format")


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}]  # fmt: skip


def test_tools_required_and_named_return_valid_tool_calls(client):
    import jsonschema

    ask = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        out = client.chat.completions.create(
            model=MODEL, messages=ask, tools=WEATHER, tool_choice=choice, max_tokens=80,
            temperature=0,
        )  # fmt: skip
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ask, tools=WEATHER, tool_choice="required", max_tokens=80,
            temperature=0, stream=True,
        )
    )  # fmt: skip
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])
    r = post(client.base_url.__str__().removesuffix("/v1/"), "/v1/chat/completions",
             {"messages": ask, "tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "nope"}}})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


# -- a migrated request's continuation (node/resume.py) ----------------------------------


def _stream_with_ids(
    url: str, path: str, body: dict, kv: list | None = None
) -> tuple[list[list], list[dict]]:
    """The node's stream as the router reads it: per event, its `ids` comment fields
    (index, chars, finished, token ids) and its chunk (None for an ids-only event); the
    fields of its `kv` comments (prefill path, cached tokens) go to `kv`."""
    events, chunks = [], []
    body = {**body, "stream": True}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120,
                      headers={"X-Pdserve-Token-Ids": "1"}) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for event in r.read().decode().split("\n\n"):
            for line in event.splitlines():
                if line.startswith(": ids "):
                    i, chars, finished, *ids = line[6:].split()
                    events.append([int(i), int(chars), finished == "1", list(map(int, ids))])
                elif line.startswith(": kv ") and kv is not None:
                    kv.append(line[5:].split())
                elif line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
    return events, chunks


def _resume_at(events: list[list], index: int, cut: int) -> dict:
    """Choice `index`'s state after its `cut`-th event: the router's `resume` entry."""
    mine = [e for e in events if e[0] == index][:cut]
    return {"index": index, "token_ids": [t for e in mine for t in e[3]], "text_chars": mine[-1][1]}


def test_a_continuation_goes_on_exactly_with_tool_calls_and_several_prompts(url):
    """The router's resume of a forced tool call halfway through its JSON: the call comes
    whole (parsed from the client's text and this node's); a batch of two prompts resumed
    at choice 1 alone goes on with choice 1's text, token for token."""
    ask = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    body = {"messages": ask, "tools": WEATHER, "tool_choice": "required", "max_tokens": 80,
            "temperature": 0}  # fmt: skip
    reports = []
    events, chunks = _stream_with_ids(url, "/v1/chat/completions", body, reports)
    (call,) = [
        tc for ch in chunks for c in ch["choices"] for tc in c["delta"].get("tool_calls") or []
    ]
    tokens = [t for e in events for t in e[3]]
    assert len(events) > 6
    resume = _resume_at(events, 0, len(events) // 2)
    kv = {"resume": [resume]}
    events2, chunks2 = _stream_with_ids(
        url, "/v1/chat/completions", {**body, "kv_transfer_params": kv}, reports
    )
    assert resume["token_ids"] + [t for e in events2 for t in e[3]] == tokens
    # one report per stream, with its first token: where the KV came from (router/migration.py
    # names the path by it); the continuation found the prompt and the resumed tokens cached
    (_, first), (prefill, cached) = reports
    assert prefill == "local_policy" and int(cached) >= int(first) + len(resume["token_ids"]) - 16
    (call2,) = [
        tc for ch in chunks2 for c in ch["choices"] for tc in c["delta"].get("tool_calls") or []
    ]
    assert call2["function"] == call["function"]
    assert chunks2[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(c["delta"].get("role") for ch in chunks2 for c in ch["choices"])

    body = {"prompt": ["The three primary colours are", FRUITS], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    events, chunks = _stream_with_ids(url, "/v1/completions", body)
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
    resume = _resume_at(events, 1, 7)
    kv = {"resume": [resume]}
    events2, chunks2 = _stream_with_ids(url, "/v1/completions", {**body, "kv_transfer_params": kv})
    assert {e[0] for e in events2} == {1}
    assert resume["token_ids"] + [t for e in events2 for t in e[3]] == [
        t for e in events if e[0] == 1 for t in e[3]
    ]
    rest = "".join(c["text"] for ch in chunks2 for c in ch["choices"])
    assert texts[1][: resume["text_chars"]] + rest == texts[1]

    # echo with logprobs: the continuation echoes nothing again, and its text offsets go
    # on after the echoed prompt, as the unfailed stream's do
    body = {"prompt": FRUITS, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 0}  # fmt: skip
    events, chunks = _stream_with_ids(url, "/v1/completions", body)
    offsets = [o for ch in chunks for c in ch["choices"] for o in c["logprobs"]["text_offset"]]
    resume = _resume_at(events, 0, 5)
    kv = {"resume": [resume]}
    _, chunks2 = _stream_with_ids(url, "/v1/completions", {**body, "kv_transfer_params": kv})
    offsets2 = [o for ch in chunks2 for c in ch["choices"] for o in c["logprobs"]["text_offset"]]
    assert offsets2 and offsets2 == offsets[len(offsets) - len(offsets2) :]
    assert len(offsets) - len(offsets2) > len(resume["token_ids"])  # the prompt's, then 5 events'
    text = "".join(c["text"] for ch in chunks for c in ch["choices"])
    assert text.startswith(FRUITS)
    rest = "".join(c["text"] for ch in chunks2 for c in ch["choices"])
    assert text[: len(FRUITS) + resume["text_chars"]] + rest == text

"""The hostile requests tests/test_hostile_input.py sends: the catalogue of malformed and
extreme bodies, constraints the sampler cannot all meet, costly requests, a slow schema."""

from __future__ import annotations

import json

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
MSG = [{"role": "user", "content": "hi"}]


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "boolean"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def raw(path: str, data: bytes, ctype: str = "application/json"):
    return (path, data, ctype)


def body(path: str = C, **fields):
    merged = {**OK, **fields} if path == C else {"messages": MSG, "max_tokens": 2, **fields}
    return (path, json.dumps(merged).encode(), "application/json")


CATALOGUE = {
    "malformed json": raw(C, b'{"prompt": "x", '),
    "json array": raw(C, b"[1, 2, 3]"),
    "json string": raw(C, b'"prompt"'),
    "empty body": raw(C, b""),
    "deep nesting": raw(C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "text/plain": raw(C, b'{"prompt": "x"}', "text/plain"),
    "invalid utf-8": raw(C, b'{"prompt": "\xff\xfe\xfa", "max_tokens": 2}'),
    "NaN temperature": raw(C, b'{"prompt": "x", "temperature": NaN}'),
    "Infinity top_p": raw(C, b'{"prompt": "x", "top_p": Infinity}'),
    "-Infinity penalty": raw(C, b'{"prompt": "x", "presence_penalty": -Infinity}'),
    "1e999 temperature": raw(C, b'{"prompt": "x", "temperature": 1e999}'),
    "10 MB body": body(prompt="a" * (10 << 20)),
    "missing prompt": raw(C, b'{"max_tokens": 2}'),
    "prompt int": body(prompt=12345),
    "cache_salt int": body(prompt="x", cache_salt=7),
    "cache_salt 257 chars": body(prompt="x", cache_salt="s" * 257),
    "prompt dict": body(prompt={"a": 1}),
    "token id -1": body(prompt=[1, -1, 2]),
    "token id 10**12": body(prompt=[10**12]),
    "token id float": body(prompt=[1.5]),
    "empty prompt": body(prompt=""),
    "prompt beyond context (ids)": body(prompt=[42] * 5000),
    "prompt beyond context (text)": body(prompt="hello " * 5000),
    "max_tokens string": body(max_tokens="ten"),
    "max_tokens -1": body(max_tokens=-1),
    "max_tokens 10**30": body(max_tokens=10**30),
    "max_tokens beyond context": body(max_tokens=100_000),
    "temperature string": body(temperature="hot"),
    "temperature -1": body(temperature=-1),
    "temperature 1e308": body(temperature=1e308),
    "top_p -1": body(top_p=-1),
    "top_k 2**70": body(top_k=2**70),
    "seed 2**70": body(seed=2**70),
    "n 0": body(n=0),
    "n -1": body(n=-1),
    "n 10**6": body(n=10**6),
    "logprobs -5": body(logprobs=-5),
    "logprobs 10**6": body(logprobs=10**6),
    "best_of 10**6": body(best_of=10**6),
    "stream string": body(stream="maybe"),
    "unknown field": body(frobnicate=1),
    "5000 stop strings": body(stop=["x"] * 5000),
    "stop int": body(stop=5),
    "logit_bias bad key": body(logit_bias={"abc": 1}),
    "logit_bias superscript key": body(logit_bias={"²": 1}),
    "schema nested 100 deep": body(CHAT, response_format=schema_format(nested_schema(100))),
    "schema of 200 KB": body(
        CHAT,
        response_format=schema_format(
            {"type": "string", "enum": [f"value-{i}" for i in range(20_000)]}
        ),
    ),
    "tool schema nested 100 deep": body(
        CHAT,
        tool_choice="required",
        tools=[{"type": "function", "function": {"name": "f", "parameters": nested_schema(100)}}],
    ),
    "logit_bias arabic-indic key": body(logit_bias={"\u0663": 1}),
    "logit_bias 10**9 entries key": body(logit_bias={"99999999999": 1}),
    "logit_bias NaN-ish": body(logit_bias={"1": 1e308}),
    "kv_transfer_params string": body(kv_transfer_params="x"),
    "kv_transfer_params unknown keys": body(kv_transfer_params={"do_remote_decode": 5}),
    "model unknown": body(model="gpt-9"),
    "chat messages string": body(CHAT, messages="hi"),
    "chat empty messages": body(CHAT, messages=[]),
    "chat bad role": body(CHAT, messages=[{"role": "hacker", "content": "x"}]),
    "chat content int": body(CHAT, messages=[{"role": "user", "content": 7}]),
    "chat top_logprobs 10**6": body(CHAT, logprobs=True, top_logprobs=10**6),
    "chat n 10**6": body(CHAT, n=10**6),
    "chat unknown field": body(CHAT, tools_of_doom=[1]),
}


BOOLEAN = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}}
# Constraints the sampler cannot all meet, or edge values of its filters: each is a client's
# own business, so it ends with a finish reason (200), never a 5xx.
UNSATISFIABLE = {
    "min_tokens vs finished grammar": dict(response_format=BOOLEAN, min_tokens=20, max_tokens=30,
                                           temperature=1),
    "min_tokens vs finished grammar, greedy": dict(response_format=BOOLEAN, min_tokens=20,
                                                   max_tokens=30, temperature=0),
    "stop ids vs grammar": dict(response_format=BOOLEAN, min_tokens=5, max_tokens=10,
                                stop_token_ids=[2], temperature=1),
    "logit_bias -100 on all": dict(logit_bias={str(t): -100 for t in range(1024)}, temperature=1),
    "top_p tiny": dict(top_p=1e-12, temperature=1),
    "min_p 1": dict(min_p=1.0, temperature=1),
    "top_k 1, temperature 100": dict(top_k=1, temperature=100),
    "temperature just above greedy": dict(temperature=1.1e-5),
    "repetition_penalty 1e-300": dict(repetition_penalty=1e-300, temperature=1),
}  # fmt: skip


COSTLY_PROMPTS = [[42] * 400] * 64
COSTLY = {
    "max_sequences_per_request": (
        C, {"prompt": COSTLY_PROMPTS, "n": 16, "echo": True, "logprobs": 20, "max_tokens": 1}
    ),
    "max_logprob_entries_per_request": (
        C, {"prompt": COSTLY_PROMPTS, "n": 4, "echo": True, "logprobs": 20, "max_tokens": 1}
    ),
    "max_logprob_entries_per_request ": (
        CHAT, {"messages": MSG, "n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 4000}
    ),
}  # fmt: skip


# An allOf of anyOfs of patterns: llguidance intersects them case by case before its
# lexer cap stops it, seconds of CPU on any box (within every size and fuel cap).
SLOW_SCHEMA = {"allOf": [{"anyOf": [{"type": "string", "pattern": f"^.*{chr(97 + i * 3 + j)}.*$"}
                                    for j in range(8)]} for i in range(5)]}  # fmt: skip

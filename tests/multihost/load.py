"""Client load for the multi-host drills: requests whose greedy answers are known from the
transformers reference, sent through the router by a few threads until stopped.

Every outcome is classified: `ok` (the exact reference text), `wrong` (an answer that is
not: a drill fails on any), `http_<status>` / `stream_error` (a terminal error: an
OpenAI-style body or an error event), `conn_error`, `timeout` (no end within the client
deadline: a drill fails on any).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx

from tests.hf_reference import hf_greedy, load_hf

CLIENT_DEADLINE_S = 30.0
MAX_TOKENS = 8
TOPICS = ["rivers", "bridges", "winter markets", "old clocks"]


@dataclass(frozen=True)
class Req:
    path: str  # /v1/completions | /v1/chat/completions
    body: dict
    expected: str


def references(model_dir: str) -> list[Req]:
    """Completions of ~150-token prompts (KV transfers of several MB) and one chat."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = load_hf(model_dir)
    reqs = []
    for topic in TOPICS:
        text = " ".join(f"Note {i} about {topic}: item {i * 7} sits on shelf {i % 5}."
                        for i in range(12))  # fmt: skip
        ids = tok.encode(text, add_special_tokens=False)
        out = tok.decode(hf_greedy(hf, ids, MAX_TOKENS), skip_special_tokens=True)
        body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        reqs.append(Req("/v1/completions", body, out))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    out = tok.decode(hf_greedy(hf, ids, 12, stop_at_eos=True), skip_special_tokens=True)
    body = {"messages": msgs, "max_tokens": 12, "temperature": 0}
    reqs.append(Req("/v1/chat/completions", body, out))
    return reqs


@dataclass
class Outcome:
    kind: str
    started: float
    ended: float
    detail: str = ""

    @property
    def took_s(self) -> float:
        return self.ended - self.started


def _text(chunk: dict, chat: bool) -> str:
    choice = chunk["choices"][0]
    if chat:
        return (choice.get("delta") or choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def send(client: httpx.Client, router: str, req: Req, stream: bool) -> Outcome:
    t0 = time.monotonic()
    chat = req.path.endswith("chat/completions")
    kind, text, detail = "ok", "", ""
    try:
        if not stream:
            r = client.post(router + req.path, json=req.body)
            if r.status_code != 200:
                kind, detail = f"http_{r.status_code}", r.json()["error"]["message"]
            else:
                text = _text(r.json(), chat)
        else:
            kind = "truncated"  # until [DONE]
            with client.stream("POST", router + req.path, json={**req.body, "stream": True}) as r:
                if r.status_code != 200:
                    r.read()
                    kind, detail = f"http_{r.status_code}", r.json()["error"]["message"]
                for line in r.iter_lines() if r.status_code == 200 else ():
                    if time.monotonic() - t0 > CLIENT_DEADLINE_S:
                        kind = "timeout"
                        break
                    if line == "data: [DONE]":
                        kind = "ok" if kind == "truncated" else kind
                        break
                    if line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            kind, detail = "stream_error", chunk["error"]["message"]
                        else:
                            text += _text(chunk, chat)
    except httpx.TimeoutException:
        kind = "timeout"
    except httpx.TransportError as e:
        kind, detail = "conn_error", str(e)
    if kind == "ok" and text != req.expected:
        kind, detail = "wrong", f"{text!r} != {req.expected!r}"
    return Outcome(kind, t0, time.monotonic(), detail)


@dataclass
class Load:
    """`clients` threads sending the reference requests (streamed every other one)."""

    router: str
    reqs: list[Req]
    clients: int = 2
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for i in range(self.clients):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _run(self, seed: int) -> None:
        n = seed
        with httpx.Client(timeout=httpx.Timeout(CLIENT_DEADLINE_S, connect=3)) as client:
            while not self._stop.is_set():
                out = send(client, self.router, self.reqs[n % len(self.reqs)], stream=n % 2 == 1)
                self.outcomes.append(out)
                n += self.clients
                if out.kind != "ok":
                    time.sleep(0.2)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(CLIENT_DEADLINE_S + 10)
        assert not any(t.is_alive() for t in self._threads), "a client is still waiting"
        return self.outcomes


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in outcomes:
        out[o.kind] = out.get(o.kind, 0) + 1
    return out

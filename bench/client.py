"""Send one streaming request to an OpenAI-compatible endpoint and time every chunk.

`send_request` never raises for a failing server: connection refused, an HTTP error
status, an error event in the stream, a stream that ends before `[DONE]` and a timeout
all come back as a `RequestRecord` with `error_kind` and `error` set, so a benchmark
always finishes and reports what went wrong.

Timing: `start` is when the request is handed to the HTTP client; each content chunk's
arrival time is recorded (`chunk_times`, seconds from `start`). Output tokens are the
server's `usage.completion_tokens` when it reports usage, else the tokenizer's count of the
text, else the number of content chunks. A pdserve node adds `pdserve_timings` to its
final chunk (docs/benchmarks-history.md, "Server timings"); those server-side TTFT stages
are kept as they came.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from pdserve.bench.datasets import BenchRequest, Tokenizer

ROUTER_WAIT_HEADER = "x-pdserve-router-wait-s"


@dataclass
class RequestRecord:
    index: int
    prompt_len: int  # server-reported prompt tokens when given, else the dataset's count
    max_tokens: int
    start: float = 0.0  # seconds since the run began
    ttft: float | None = None  # first content chunk, seconds after start
    e2e: float | None = None  # last event, seconds after start
    chunk_times: list[float] = field(default_factory=list)  # content chunks, after start
    chunk_tokens: list[int] = field(
        default_factory=list
    )  # tokens listed per chunk (logprobs), else 0
    output_tokens: int = 0
    output_tokens_source: str = "none"  # usage | tokenizer | chunks
    ok: bool = False
    error_kind: str | None = (
        None  # connect | http_<status> | server_error | incomplete | timeout | other
    )
    error: str | None = None
    server_timings: dict | None = None  # pdserve_timings from the response, as sent

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(frozen=True)
class EndpointConfig:
    base_url: str
    endpoint: str  # /v1/completions or /v1/chat/completions
    model: str | None
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return "chat" in self.endpoint


def request_body(cfg: EndpointConfig, req: BenchRequest) -> dict:
    body: dict = {
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": cfg.ignore_eos,
    }
    if cfg.model:
        body["model"] = cfg.model
    if cfg.is_chat:
        if not isinstance(req.prompt, str):
            body["prompt_token_ids"] = req.prompt  # pdserve's extension; others need text
            body["messages"] = [{"role": "user", "content": ""}]
        else:
            body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(cfg.extra_body)
    return body


def _chunk_content(event: dict, is_chat: bool) -> tuple[str, int]:
    """The chunk's text and its token count when it lists them (logprobs), else 0.

    A chunk carries output if it has text or tokens: a model without a tokenizer streams
    empty text, but with `logprobs` requested each chunk still lists its tokens.
    """
    text, tokens = "", 0
    for choice in event.get("choices") or []:
        if is_chat:
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
        lp = choice.get("logprobs") or {}
        tokens += len(lp.get("tokens") or lp.get("content") or [])
    return text, tokens


def _error_message(event_or_body) -> str:
    if isinstance(event_or_body, dict):
        err = event_or_body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)
        if err is not None:
            return str(err)
    return str(event_or_body)[:300]


async def _lines(body: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines (without the newline) as the network delivers them; no limit on a
    line's length (aiohttp's own line reader refuses one over 128 KiB)."""
    rest = b""
    async for data in body.iter_any():
        *lines, rest = (rest + data).split(b"\n")
        for line in lines:
            yield line
    if rest:
        yield rest


async def send_request(
    client: aiohttp.ClientSession,
    cfg: EndpointConfig,
    req: BenchRequest,
    index: int,
    t0: float,
    tok: Tokenizer | None = None,
) -> RequestRecord:
    """Send `req`, streaming; `t0` is the run's start (time.perf_counter())."""
    rec = RequestRecord(index=index, prompt_len=req.prompt_len, max_tokens=req.output_len)
    start = time.perf_counter()
    rec.start = start - t0
    text, usage, done = "", None, False
    # Like httpx's Timeout(t, connect=...): t for each read, not for the whole stream.
    timeout = aiohttp.ClientTimeout(
        total=None, sock_read=cfg.timeout_s, sock_connect=min(cfg.timeout_s, 30.0)
    )
    try:
        async with client.post(
            cfg.base_url + cfg.endpoint, json=request_body(cfg, req), timeout=timeout
        ) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")
                try:
                    msg = _error_message(json.loads(body))
                except ValueError:
                    msg = body[:300]
                return _fail(rec, start, f"http_{resp.status}", msg)
            router_wait = resp.headers.get(ROUTER_WAIT_HEADER)
            async for raw in _lines(resp.content):
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                now = time.perf_counter() - start
                if data == b"[DONE]":
                    done = True
                    rec.e2e = now
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    shown = data[:200].decode(errors="replace")
                    return _fail(rec, start, "other", f"unparseable event: {shown}")
                if "error" in event and not event.get("choices"):
                    return _fail(rec, start, "server_error", _error_message(event))
                piece, n_tokens = _chunk_content(event, cfg.is_chat)
                if piece or n_tokens:
                    if rec.ttft is None:
                        rec.ttft = now
                    rec.chunk_times.append(now)
                    rec.chunk_tokens.append(n_tokens)
                    text += piece
                rec.e2e = now
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("pdserve_timings"):
                    rec.server_timings = event["pdserve_timings"]
    except TimeoutError as e:  # aiohttp's read and connect timeouts are TimeoutErrors
        return _fail(rec, start, "timeout", f"{type(e).__name__} after {cfg.timeout_s} s")
    except aiohttp.ClientConnectorError as e:
        return _fail(rec, start, "connect", f"{type(e).__name__}: {e}")
    except (aiohttp.ClientError, OSError) as e:
        kind = "incomplete" if rec.chunk_times else "other"
        return _fail(rec, start, kind, f"{type(e).__name__}: {e}")
    if not done:
        n = len(rec.chunk_times)
        return _fail(rec, start, "incomplete", f"stream ended without [DONE] after {n} chunks")
    if router_wait is not None:
        try:
            timings = dict(rec.server_timings or {})
            stages = dict(timings.get("stages") or {})
            stages.setdefault("router_wait", float(router_wait))
            timings["stages"] = stages
            rec.server_timings = timings
        except ValueError:
            pass
    _count_output(rec, usage, text, tok)
    rec.ok = rec.ttft is not None
    if not rec.ok:
        rec.error_kind, rec.error = "incomplete", "stream finished without any output token"
    return rec


def _count_output(rec: RequestRecord, usage: dict | None, text: str, tok) -> None:
    if usage and isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens, rec.output_tokens_source = usage["completion_tokens"], "usage"
        if isinstance(usage.get("prompt_tokens"), int):
            rec.prompt_len = usage["prompt_tokens"]
    elif tok is not None:
        rec.output_tokens, rec.output_tokens_source = tok.count(text), "tokenizer"
    else:
        rec.output_tokens, rec.output_tokens_source = len(rec.chunk_times), "chunks"


def _fail(rec: RequestRecord, start: float, kind: str, message: str) -> RequestRecord:
    rec.ok, rec.error_kind, rec.error = False, kind, message
    rec.e2e = time.perf_counter() - start
    return rec

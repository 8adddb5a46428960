"""A non-streamed request served as a stream, so that it too survives its decode node.

The router asks the node for a stream (with the token ids, like any stream it relays) and
runs it through the same `StreamRelay` (router/migration.py): if the node fails after its
first token, the request moves to another decode node as a continuation. `collect` reads
the relayed events and builds the one JSON body the node itself would have answered
(node/openai_responses.py `completion_response` / `chat_response`): each choice's text and
logprobs in order, its finish reason, the usage (rewritten by the relay after a
migration), `pdserve_timings` of choice 0. An error event becomes an error answer.

Every request takes this way (several prompts, `n`, `echo`, `tools` included);
`router.migrate_buffered: false` turns it off. A chat choice's tool calls come in the delta
that ends it; its content is then what the node's own answer holds next to calls: nothing
for a forced call (whose stream carries no text), the reply without its `<tool_call>`
blocks for `tool_choice: auto` (pdserve/api/chat_tools.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import msgspec

from pdserve.api.chat_tools import strip_tool_calls
from pdserve.router.relay import DONE


class _Choice:
    __slots__ = ("text", "logprobs", "finish_reason", "timings", "tool_calls")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: dict | None = None
        self.finish_reason: str | None = None
        self.timings: dict | None = None
        self.tool_calls: list[dict] | None = None


def _events(data: bytes) -> list[bytes]:
    return [e for e in data.split(b"\n\n") if e.startswith(b"data: ")]


def _add_logprobs(c: _Choice, lp: dict | None, chat: bool) -> None:
    """Append one chunk's logprobs to the choice's (lists concatenated in order)."""
    if lp is None:
        return
    if c.logprobs is None:
        c.logprobs = {"content": []} if chat else {
            "tokens": [], "token_logprobs": [], "top_logprobs": None
        }  # fmt: skip
    if chat:
        c.logprobs["content"] += lp.get("content") or []
        return
    for name in ("tokens", "token_logprobs"):  # text_offset: recounted in `_choice`
        c.logprobs[name] += lp.get(name) or []
    if lp.get("top_logprobs") is not None:
        c.logprobs["top_logprobs"] = (c.logprobs["top_logprobs"] or []) + lp["top_logprobs"]


def _error_status(err: dict) -> int:
    if err.get("type") == "invalid_request_error":
        return 400
    return 500 if err.get("code") == "engine_error" else 502


async def collect(events: AsyncIterator[bytes], chat: bool) -> tuple[int, bytes]:
    """(status, JSON body) of a relayed stream read to its end."""
    choices: dict[int, _Choice] = {}
    head: dict | None = None
    usage = None
    async with aclosing(events) as relayed:
        async for data in relayed:
            for event in _events(data):
                if event + b"\n\n" == DONE:
                    continue
                chunk = msgspec.json.decode(event[6:])
                if "error" in chunk:
                    return _error_status(chunk["error"] or {}), msgspec.json.encode(chunk)
                if head is None:
                    head = chunk
                if chunk.get("usage") is not None:
                    usage = chunk["usage"]
                timings = chunk.get("pdserve_timings")
                for ch in chunk.get("choices") or ():
                    c = choices.setdefault(ch["index"], _Choice())
                    delta = ch.get("delta") or {}
                    piece = delta.get("content") if chat else ch.get("text")
                    if piece:
                        c.text.append(piece)
                    if delta.get("tool_calls"):
                        c.tool_calls = [_call(t) for t in delta["tool_calls"]]
                    _add_logprobs(c, ch.get("logprobs"), chat)
                    if ch.get("finish_reason") is not None:
                        c.finish_reason = ch["finish_reason"]
                        c.timings = timings
    if head is None:  # nothing came: the relay ends every stream with an event
        raise RuntimeError("a relayed stream ended without an event")
    out = {
        "id": head.get("id"),
        "object": "chat.completion" if chat else "text_completion",
        "created": head.get("created") or int(time.time()),
        "model": head.get("model"),
        "choices": [_choice(i, choices[i], chat) for i in sorted(choices)],
        "usage": usage,
    }
    first = choices.get(0)
    if first is not None and first.timings is not None:
        out["pdserve_timings"] = first.timings
    return 200, msgspec.json.encode(out)


def _choice(index: int, c: _Choice, chat: bool) -> dict:
    text = "".join(c.text)
    if chat:
        content = text if c.tool_calls is None else strip_tool_calls(text) or None
        message = {"role": "assistant", "content": content, "tool_calls": c.tool_calls}
        return {"index": index, "message": message, "logprobs": c.logprobs,
                "finish_reason": c.finish_reason}  # fmt: skip
    if c.logprobs is not None:  # as the node's buffered answer counts them: token strings
        offsets, at = [], 0
        for t in c.logprobs["tokens"]:
            offsets.append(at)
            at += len(t)
        c.logprobs["text_offset"] = offsets
    return {"index": index, "text": text, "logprobs": c.logprobs,
            "finish_reason": c.finish_reason}  # fmt: skip


def _call(delta_call: dict) -> dict:
    """A streamed tool call (with its `index`) as a message's tool call."""
    return {"id": delta_call.get("id"), "type": delta_call.get("type") or "function",
            "function": delta_call.get("function")}  # fmt: skip

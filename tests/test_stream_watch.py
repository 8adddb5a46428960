"""The router's watch over relayed streams (router/stream_watch.py), the abort it uses
(router/node_http.py `NodeResponse.abort`), and the buffered answer it builds from a
relayed stream (router/buffered.py). The whole path through real nodes is in
tests/faults/test_migration.py."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from pdserve.router.breaker import CircuitBreaker
from pdserve.router.buffered import collect
from pdserve.router.node_http import NodeHTTPError, NodePool
from pdserve.router.stream_watch import StreamWatch, out_of_service


class _Response:
    def __init__(self) -> None:
        self.aborted: Exception | None = None

    def abort(self, error: Exception) -> None:
        self.aborted = error


def _node(alive=True, stuck=False, failures=0):
    b = CircuitBreaker(failures=2, cooldown_s=60)
    for _ in range(failures):
        b.record_failure()
    return SimpleNamespace(url="http://n", alive=alive, stuck=stuck, breaker=b,
                           last_error="timeout")  # fmt: skip


class _Relay(SimpleNamespace):
    __hash__ = object.__hash__


def _relay(node, silent_s: float, now: float):
    return _Relay(
        reading=SimpleNamespace(response=_Response()),
        node=node,
        last_read=now - silent_s,
        ctx=SimpleNamespace(rid="r1"),
    )


def test_only_silent_streams_of_nodes_out_of_service_are_cut():
    now = time.monotonic()
    w = StreamWatch(silent_after_s=3.0)
    cases = {
        "probe failed, silent": (_node(alive=False), 5.0, True),
        "stuck, silent": (_node(stuck=True), 5.0, True),
        "breaker open, silent": (_node(failures=2), 5.0, True),
        "probe failed, still flowing": (_node(alive=False), 0.5, False),
        "healthy, silent": (_node(), 60.0, False),  # a slow but healthy node keeps it
    }
    relays = {k: _relay(n, silent, now) for k, (n, silent, _) in cases.items()}
    responses = {k: r.reading.response for k, r in relays.items()}
    w.relays.update(relays.values())
    assert w.check(now) == 3
    for k, (_, _, cut) in cases.items():
        assert (responses[k].aborted is not None) == cut, k
        assert (relays[k].reading is None) == cut, k
    assert "health probe" in str(responses["probe failed, silent"].aborted)
    assert w.check(now) == 0  # a cut stream is not cut twice
    assert out_of_service(_node()) is None


def test_abort_fails_a_pending_read_at_once():
    """A node that sent headers and one chunk, then nothing (a frozen process): the read
    waiting on it raises the abort's error right away, not at the read deadline."""

    async def main() -> None:
        async def silent_node(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(3600)

        server = await asyncio.start_server(silent_node, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = NodePool(f"http://127.0.0.1:{port}", {}, None, 2.0, 600.0)
        resp = await pool.post("/v1/completions", b"{}", {})
        assert await resp.__anext__() == b"hello"
        pending = asyncio.ensure_future(resp.__anext__())
        await asyncio.sleep(0.2)
        assert not pending.done()
        t0 = time.monotonic()
        resp.abort(NodeHTTPError("cut by the test"))
        with pytest.raises(NodeHTTPError, match="cut by the test"):
            await asyncio.wait_for(pending, 5)
        assert time.monotonic() - t0 < 1.0
        resp.release()  # a no-op after the abort
        server.close()

    asyncio.run(main())


def _sse(*chunks) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)


async def _events(*parts: bytes):
    for p in parts:
        yield p


def test_buffered_answer_from_a_stream_with_logprobs_and_usage():
    head = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}

    def piece(text, tokens, lps, finish=None, **extra):
        lp = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None,
              "text_offset": [99] * len(tokens)}  # fmt: skip
        return {**head, "choices": [{"index": 0, "text": text, "logprobs": lp,
                                     "finish_reason": finish}], "usage": None, **extra}  # fmt: skip

    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    parts = (
        _sse(piece("Hel", ["Hel"], [-0.5])),
        # after a migration: the continuation's chunks, then its (rewritten) usage
        _sse(
            piece("lo", ["l", "o"], [-0.1, -0.2], "length", pdserve_timings={"ttft_s": 1}),
            {**head, "choices": [], "usage": usage},
        ),  # fmt: skip
        b"data: [DONE]\n\n",
    )
    status, body = asyncio.run(collect(_events(*parts), chat=False))
    out = json.loads(body)
    assert status == 200
    assert out["choices"] == [{
        "index": 0, "text": "Hello", "finish_reason": "length",
        "logprobs": {"tokens": ["Hel", "l", "o"], "token_logprobs": [-0.5, -0.1, -0.2],
                     "top_logprobs": None, "text_offset": [0, 3, 4]},
    }]  # fmt: skip
    assert out["usage"] == usage and out["pdserve_timings"] == {"ttft_s": 1}
    assert out["object"] == "text_completion" and out["id"] == "cmpl-1"


def test_buffered_chat_answer_and_an_error_event():
    head = {"id": "chatcmpl-1", "created": 7, "model": "m"}
    parts = (
        _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
             {**head, "choices": [{"index": 1, "delta": {"content": "b"}, "finish_reason": "stop"}]},
             {**head, "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}]}),
        b"data: [DONE]\n\n",
    )  # fmt: skip
    status, body = asyncio.run(collect(_events(*parts), chat=True))
    out = json.loads(body)
    assert status == 200 and out["object"] == "chat.completion"
    assert [c["message"]["content"] for c in out["choices"]] == ["a", "b"]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    err = {"error": {"message": "the node serving this request failed", "type": "server_error",
                     "code": "upstream_error"}}  # fmt: skip
    status, body = asyncio.run(collect(_events(_sse(err), b"data: [DONE]\n\n"), chat=True))
    assert status == 502 and json.loads(body) == err


def test_buffered_chat_answer_with_tool_calls():
    """A forced call streams no content: the answer's content is null; with `auto`, the
    content is the reply without its <tool_call> block, as a node's own answer has it."""
    head = {"id": "chatcmpl-1", "created": 7, "model": "m"}
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    reply = (
        'Let me look. <tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    parts = (
        _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
             {**head, "choices": [{"index": 1, "delta": {"content": reply[:20]}}]},
             {**head, "choices": [{"index": 1, "delta": {"content": reply[20:],
                                                          "tool_calls": [call]},
                                   "finish_reason": "tool_calls"}]},
             {**head, "choices": [{"index": 0, "delta": {"content": "", "tool_calls": [call]},
                                   "finish_reason": "tool_calls"}]}),
        b"data: [DONE]\n\n",
    )  # fmt: skip
    status, body = asyncio.run(collect(_events(*parts), chat=True))
    out = json.loads(body)
    assert status == 200
    want = [{"id": "call_1", "type": "function", "function": call["function"]}]
    forced, auto = out["choices"]
    assert forced["message"] == {"role": "assistant", "content": None, "tool_calls": want}
    assert auto["message"] == {"role": "assistant", "content": "Let me look.", "tool_calls": want}
    assert forced["finish_reason"] == auto["finish_reason"] == "tool_calls"

"""One attempt of one request on one decode node: send it, and hold its response back until
it is safe to commit to.

An attempt *fails* (and may be retried on another node) when the connection fails, the node
answers 5xx, or, streaming, the stream breaks or carries an error before its first token.
Until then nothing has reached the client. A 4xx is the client's fault: it is relayed as it
is, never retried. Only a *node fault* counts toward the node's circuit breaker
(`AttemptFailed.node_fault`): a transport error, a 503, or an `engine_dead` error; a 500
about one request (whose own input may have caused it) does not, so no client can open
every node's breaker. Once a token has been relayed, a broken stream ends with an OpenAI-style
error event and `data: [DONE]`.

The node client is `NodePool` (router/node_http.py: keep-alive connections, httptools
parser): per request it costs a fraction of the CPU of aiohttp (which cost half of httpx),
and the router relays every token.

SSE framing: the node frames each event as `data: <json>\\n\\n`; `SSESplitter` cuts the byte
stream at blank lines (any split of the bytes across reads) and `Chunk` decodes only the
fields the router looks at.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from pdserve.router.node_http import NodeResponse
from pdserve.router.nodes import NodeState

# What a failed exchange with a node raises (connection, protocol, deadline).
NODE_ERRORS = (OSError, asyncio.TimeoutError)

DONE = b"data: [DONE]\n\n"


class AttemptFailed(Exception):
    """The node could not serve this attempt; another node may."""

    def __init__(
        self,
        reason: str,
        message: str,
        status: int = 502,
        body: bytes | None = None,
        node_fault: bool = True,
    ):
        super().__init__(message)
        self.reason = reason  # connect | status | stream | prefill_rejected
        self.status = status
        self.body = body  # the node's own error body, relayed if no retry is left
        self.node_fault = node_fault  # counts toward the node's breaker


def _engine_dead(error: object) -> bool:
    return isinstance(error, dict) and error.get("code") == "engine_dead"


class _Details(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    prompt_tokens_details: _Details | None = None


class Chunk(msgspec.Struct):
    """The parts of a streamed chunk the router reads (the rest is relayed untouched)."""

    choices: list[msgspec.Raw] = []
    usage: _Usage | None = None
    error: dict | None = None


_chunk_decoder = msgspec.json.Decoder(Chunk)


def cached_tokens(answer: bytes) -> int:
    """`usage.prompt_tokens_details.cached_tokens` of a JSON answer (0 if absent)."""
    try:
        usage = _chunk_decoder.decode(answer).usage
    except msgspec.DecodeError:
        return 0
    details = usage.prompt_tokens_details if usage else None
    return details.cached_tokens if details else 0


def decode_event(event: bytes) -> Chunk | None:
    """The chunk of a `data: {...}` event; None for `[DONE]` or anything not JSON."""
    if not event.startswith(b"data: ") or event.startswith(DONE[:12]):
        return None
    try:
        return _chunk_decoder.decode(event[6:].strip())
    except msgspec.DecodeError:
        return None


class SSESplitter:
    """Cut a byte stream into complete SSE events (each returned with its `\\n\\n`)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        events = []
        while (i := self._buf.find(b"\n\n")) >= 0:
            events.append(self._buf[: i + 2])
            self._buf = self._buf[i + 2 :]
        return events


@dataclass
class NodeAnswer:
    """A node's complete answer (a JSON request, or a non-200 to a streaming one)."""

    status_code: int
    content: bytes


@dataclass
class OpenStream:
    """A stream that has produced its first token: `held` events, then the rest."""

    response: NodeResponse
    held: list[bytes]
    rest: AsyncIterator[bytes]  # raw bytes after the held events
    splitter: SSESplitter

    def close(self) -> None:
        """Done with the node's stream: a stream read to its end keeps its connection
        (keep-alive); one cut short closes it, so the node sees the disconnect and aborts."""
        self.response.release()


def _check_status(node: NodeState, status: int, content: bytes) -> None:
    """Raise AttemptFailed for a 5xx, or for a decode node refusing the chosen prefill node
    (it may not have seen that node in the registry yet): another choice may work."""
    if status >= 500:
        fault = status != 500
        if not fault:
            try:
                fault = _engine_dead(msgspec.json.decode(content).get("error"))
            except (msgspec.DecodeError, AttributeError):
                fault = False  # a crash on one request (its input?): a 503 or death is a fault
        raise AttemptFailed("status", f"{node.url} answered {status}", status, content, fault)
    if status == 400 and b"kv_transfer_params.prefill_node" in content:
        try:
            param = msgspec.json.decode(content)["error"]["param"]
        except (msgspec.DecodeError, KeyError, TypeError):
            return
        if param == "kv_transfer_params.prefill_node":
            raise AttemptFailed(
                "prefill_rejected", f"{node.url} refused the prefill node", 400, content
            )


def encode_body(body: dict) -> bytes:
    """The JSON body for a node (msgspec: several times faster than the stdlib encoder;
    the caller has already rejected NaN and infinities)."""
    return msgspec.json.encode(body)


async def send_json(node: NodeState, path: str, body: bytes, headers: dict) -> NodeAnswer:
    """A non-streaming attempt (`body`: JSON bytes): the node's whole answer, or
    AttemptFailed."""
    try:
        resp = await node.http.post(path, body, headers)
        try:
            answer = NodeAnswer(resp.status, await resp.read())
        finally:
            resp.release()
    except NODE_ERRORS as e:
        raise AttemptFailed("connect", f"{node.url}: {type(e).__name__}: {e}") from e
    _check_status(node, answer.status_code, answer.content)
    return answer


async def open_stream(
    node: NodeState, path: str, body: bytes, headers: dict, preamble_events: int
) -> OpenStream | NodeAnswer:
    """Start a streaming attempt and read up to its first token.

    Returns an `OpenStream`, or the node's complete non-200 answer (a 4xx to relay).
    `preamble_events` leading events carry no token (chat's role chunk) and do not count.
    Raises AttemptFailed when the attempt fails before its first token.
    """
    try:
        resp = await node.http.post(path, body, headers)
    except NODE_ERRORS as e:
        raise AttemptFailed("connect", f"{node.url}: {type(e).__name__}: {e}") from e
    try:
        if resp.status != 200:
            answer = NodeAnswer(resp.status, await resp.read())
            resp.release()
            _check_status(node, answer.status_code, answer.content)
            return answer
        splitter = SSESplitter()
        held: list[bytes] = []
        raw = aiter(resp)
        async for data in raw:
            events = splitter.feed(data)  # one read may carry several events
            for k, event in enumerate(events):
                held.append(event)
                if len(held) <= preamble_events:
                    continue
                chunk = decode_event(event)
                if chunk is not None and chunk.error is not None:
                    raise AttemptFailed(
                        "stream",
                        f"{node.url} failed the request: {event[6:200]!r}",
                        node_fault=_engine_dead(chunk.error),
                    )
                held += events[k + 1 :]  # the first token is in: the rest of the read too
                return OpenStream(resp, held, raw, splitter)
        raise AttemptFailed("stream", f"{node.url} ended the stream before its first token")
    except NODE_ERRORS as e:
        resp.close()
        raise AttemptFailed("stream", f"{node.url}: {type(e).__name__}: {e}") from e
    except BaseException:
        resp.close()
        raise

"""One attempt of one request on one decode node: send it, and hold its response back until
it is safe to commit to.

An attempt *fails* (and may be retried on another node) when the connection fails, the node
answers 5xx, or, streaming, the stream breaks or carries an error before its first token.
Until then nothing has reached the client. A 4xx is the client's fault: it is relayed as it
is, never retried. Once a token has been relayed, a broken stream ends with an OpenAI-style
error event and `data: [DONE]`.

SSE framing: the node frames each event as `data: <json>\\n\\n`; `SSESplitter` cuts the byte
stream at blank lines (any split of the bytes across reads) and `Chunk` decodes only the
fields the router looks at.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import msgspec

from router.nodes import NodeState

DONE = b"data: [DONE]\n\n"


class AttemptFailed(Exception):
    """The node could not serve this attempt; another node may."""

    def __init__(self, reason: str, message: str, status: int = 502, body: bytes | None = None):
        super().__init__(message)
        self.reason = reason  # connect | status | stream | prefill_rejected
        self.status = status
        self.body = body  # the node's own error body, relayed if no retry is left


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
class OpenStream:
    """A stream that has produced its first token: `held` events, then the rest."""

    response: httpx.Response
    held: list[bytes]
    rest: AsyncIterator[bytes]  # raw bytes after the held events
    splitter: SSESplitter


def _check_status(node: NodeState, resp: httpx.Response) -> None:
    """Raise AttemptFailed for a 5xx, or for a decode node refusing the chosen prefill node
    (it may not have seen that node in the registry yet): another choice may work."""
    if resp.status_code >= 500:
        raise AttemptFailed(
            "status", f"{node.url} answered {resp.status_code}", resp.status_code, resp.content
        )
    if resp.status_code == 400 and b"kv_transfer_params.prefill_node" in resp.content:
        try:
            param = msgspec.json.decode(resp.content)["error"]["param"]
        except (msgspec.DecodeError, KeyError, TypeError):
            return
        if param == "kv_transfer_params.prefill_node":
            raise AttemptFailed(
                "prefill_rejected", f"{node.url} refused the prefill node", 400, resp.content
            )


def encode_body(body: dict) -> bytes:
    """The JSON body for a node (msgspec: several times faster than the stdlib encoder
    httpx uses; the caller has already rejected NaN and infinities)."""
    return msgspec.json.encode(body)


async def send_json(node: NodeState, path: str, body: bytes, headers: dict) -> httpx.Response:
    """A non-streaming attempt (`body`: JSON bytes): the node's whole answer, or
    AttemptFailed."""
    try:
        resp = await node.client.post(path, content=body, headers=headers)
    except httpx.HTTPError as e:
        raise AttemptFailed("connect", f"{node.url}: {type(e).__name__}: {e}") from e
    _check_status(node, resp)
    return resp


async def open_stream(
    node: NodeState, path: str, body: bytes, headers: dict, preamble_events: int
) -> OpenStream | httpx.Response:
    """Start a streaming attempt and read up to its first token.

    Returns an `OpenStream`, or the node's complete non-200 response (a 4xx to relay).
    `preamble_events` leading events carry no token (chat's role chunk) and do not count.
    Raises AttemptFailed when the attempt fails before its first token.
    """
    request = node.client.build_request("POST", path, content=body, headers=headers)
    try:
        resp = await node.client.send(request, stream=True)
    except httpx.HTTPError as e:
        raise AttemptFailed("connect", f"{node.url}: {type(e).__name__}: {e}") from e
    try:
        if resp.status_code != 200:
            await resp.aread()
            _check_status(node, resp)
            return resp
        splitter = SSESplitter()
        held: list[bytes] = []
        raw = resp.aiter_raw()
        async for data in raw:
            for event in splitter.feed(data):
                held.append(event)
                if len(held) <= preamble_events:
                    continue
                chunk = decode_event(event)
                if chunk is not None and chunk.error is not None:
                    raise AttemptFailed(
                        "stream", f"{node.url} failed the request: {event[6:200]!r}"
                    )
                return OpenStream(resp, held, raw, splitter)
        raise AttemptFailed("stream", f"{node.url} ended the stream before its first token")
    except httpx.HTTPError as e:
        await resp.aclose()
        raise AttemptFailed("stream", f"{node.url}: {type(e).__name__}: {e}") from e
    except BaseException:
        await resp.aclose()
        raise

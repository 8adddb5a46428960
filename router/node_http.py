"""The router's HTTP/1.1 client to one node, for the request path: a keep-alive pool of
asyncio connections whose answers are parsed by httptools (the C parser uvicorn uses).

aiohttp (still used for health probes) spent more CPU per request here than the rest of the
routing; this client writes each request in one `write` and hands the body on
as the parser produces it. Semantics the router relies on:

- a response read to its end (and not `Connection: close`) returns its connection to the
  pool; one cut short (`close()`, or `release()` before the end) closes it, so the node
  sees the disconnect and aborts the request;
- idle connections are dropped after `keepalive_s` (4 s), before the node's HTTP server
  (uvicorn: 5 s) closes them, so a request never goes out on a connection being closed;
- deadlines: `connect_timeout_s` to connect, `read_timeout_s` between two reads (a stream
  may be long); failures raise `NodeHTTPError` (an OSError) or `asyncio.TimeoutError`.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

_PAUSE_BYTES = 1 << 20  # unread body bytes at which the connection stops reading


class NodeHTTPError(OSError):
    """The node's connection failed or its answer was not valid HTTP."""


class NodePool:
    def __init__(self, url: str, headers: dict[str, str], ssl_context: ssl.SSLContext | None,
                 connect_timeout_s: float, read_timeout_s: float, keepalive_s: float = 4.0):  # fmt: skip
        u = urlsplit(url)
        self.url = url
        self.host, self.port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.base_path = u.path.rstrip("/")
        self.ssl = ssl_context if u.scheme == "https" else None
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.keepalive_s = keepalive_s
        fixed = {"Host": u.netloc, **headers}
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self._idle: list[_Conn] = []

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> NodeResponse:
        """Send one request; returns once the answer's status and headers are in."""
        conn = await self._acquire()
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head = (f"POST {self.base_path}{path} HTTP/1.1\r\n{self._head}{extra}"
                f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
        conn.start()
        conn.transport.write(head.encode("latin-1") + body)
        try:
            await conn.wait(lambda: conn.status, self.read_timeout_s)
        except BaseException:
            conn.transport.close()
            raise
        return NodeResponse(self, conn)

    async def _acquire(self) -> _Conn:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.transport.close()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    _Conn, self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                ),
                self.connect_timeout_s,
            )  # fmt: skip
        except OSError as e:
            raise NodeHTTPError(f"cannot connect to {self.url}: {e}") from e
        return conn

    def _release(self, conn: _Conn) -> None:
        if conn.done and conn.keep_alive and not conn.lost:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.transport.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.transport.close()
        self._idle.clear()


class NodeResponse:
    """A node's answer: `status`, then its body (`read()`, or chunks by `async for`)."""

    def __init__(self, pool: NodePool, conn: _Conn):
        self._pool, self._conn = pool, conn
        self.status = conn.status
        self.url = pool.url
        self._finished = False

    def at_eof(self) -> bool:
        return self._conn.done and not self._conn.chunks

    async def read(self) -> bytes:
        parts = []
        async for chunk in self:
            parts.append(chunk)
        return b"".join(parts)

    def __aiter__(self) -> NodeResponse:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        if not conn.chunks and not conn.done:
            await conn.wait(lambda: conn.chunks or conn.done, self._pool.read_timeout_s)
        if conn.chunks:
            return conn.take()
        raise StopAsyncIteration

    def release(self) -> None:
        """Done with this answer: its connection back to the pool if the answer was read to
        its end, else closed."""
        if not self._finished:
            self._finished = True
            if self.at_eof():
                self._pool._release(self._conn)
            else:
                self._conn.transport.close()

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._conn.transport.close()

    def abort(self, error: Exception) -> None:
        """Fail this answer now: a pending or later read raises `error`, and the
        connection is dropped at once (no wait for its write buffer: the node may be gone)."""
        if not self._finished:
            self._finished = True
            conn = self._conn
            if conn.error is None:
                conn.error = error
            conn.transport.abort()
            conn._wake()


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future | None = None
        self.start()

    def start(self) -> None:
        """Ready for the next answer."""
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.keep_alive = True
        self.done = False
        self.error: Exception | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False

    async def wait(self, ready, timeout_s: float) -> None:
        """Until `ready()` (or the connection fails: raised)."""
        loop = asyncio.get_running_loop()
        while not ready():
            if self.error is not None:
                raise self.error
            self._waiter = loop.create_future()
            timer = loop.call_later(timeout_s, self._expire, self._waiter)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None

    def take(self) -> bytes:
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered < _PAUSE_BYTES // 2:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    @staticmethod
    def _expire(waiter: asyncio.Future) -> None:
        if not waiter.done():
            waiter.set_exception(asyncio.TimeoutError("the node did not answer in time"))

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.error = NodeHTTPError(f"bad HTTP from the node: {e}")
            self.transport.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.done and self.error is None:
            self.error = NodeHTTPError(f"the node closed the connection: {exc!r}")
        self._wake()

    # -- httptools callbacks -------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"connection" and value.lower() == b"close":
            self.keep_alive = False

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.keep_alive and self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _PAUSE_BYTES and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.done = True

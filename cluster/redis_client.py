"""The asyncio Redis clients of the router: redis-py with hiredis on both ends, and a lean
one for the KV index lookup on the request path.

redis-py parses replies with hiredis when it is installed, but its asyncio connection packs
every command in Python (one `encode` per argument). A KV index lookup sends ~130
arguments (a key per candidate node, a hash per prompt block), so packing cost the router
more CPU than the whole policy step; `connect()` gives connections that pack with
`hiredis.pack_command` in one call instead. The lookup itself goes through `LeanRedis`
(below), which skips redis-py's per-command machinery altogether.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from urllib.parse import unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

try:
    import hiredis
except ImportError:  # plain packing
    hiredis = None


class HiredisPackConnection(Connection):
    """A TCP connection whose commands are packed in C (str, bytes, int, float arguments;
    anything else goes the plain way, which raises redis-py's own errors)."""

    def pack_command(self, *args) -> list[bytes]:
        if isinstance(args[0], str) and " " in args[0]:  # "CONFIG GET": words go apart
            args = (*args[0].split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:
            return super().pack_command(*args)


def connect(url: str, **kwargs) -> Redis:
    """`Redis.from_url(url, **kwargs)`, packing in C for plain `redis://` URLs."""
    if hiredis is not None and url.startswith("redis://"):
        kwargs.setdefault("connection_class", HiredisPackConnection)
    return Redis.from_url(url, **kwargs)


class LeanRedis:
    """The router's KV-index client: one TCP connection, commands pipelined on it (replies
    come back in order, each to its waiter), packed and parsed by hiredis, for `redis://`
    URLs (`lean_client()` gives None for anything else: redis-py serves those).

    redis-py's asyncio client spends more CPU per command around the packed bytes
    (connection pool, retries, event hooks) than the lookup's own work. Errors are
    redis-py's classes: `ConnectionError` (cannot connect, connection lost), `TimeoutError`
    (no reply within `timeout_s`: the connection is dropped, since later replies would be
    out of step), `ResponseError` (an error reply). A lost connection is reopened by the
    next command.
    """

    def __init__(self, host: str, port: int, db: int, username: str | None,
                 password: str | None, timeout_s: float):  # fmt: skip
        self.host, self.port, self.db = host, port, db
        self.username, self.password = username, password
        self.timeout_s = timeout_s
        self._proto: _RespProtocol | None = None
        self._connecting: asyncio.Future | None = None

    async def execute(self, *args):
        proto = self._proto
        if proto is None or proto.lost:
            proto = await self._connect()
        return await proto.call(args, self.timeout_s)

    async def pipeline(self, commands: list[tuple]) -> list:
        """Several commands in one write; their replies in order (an error reply raises)."""
        proto = self._proto
        if proto is None or proto.lost:
            proto = await self._connect()
        return await proto.call_many(commands, self.timeout_s)

    def script(self, text: str):
        """An async `script(keys=[...], args=[...])`: EVALSHA, and EVAL when Redis does not
        know the script (first use, or after a restart). `script.start(keys, args)` is the
        same call begun now: see `start`."""
        sha = hashlib.sha1(text.encode()).hexdigest()

        async def run(keys: list, args: list):
            try:
                return await self.execute("EVALSHA", sha, len(keys), *keys, *args)
            except ResponseError as e:
                if not str(e).startswith("NOSCRIPT"):
                    raise
            return await self.execute("EVAL", text, len(keys), *keys, *args)

        def start(keys: list, args: list) -> Pending:
            proto = self._proto
            if proto is None or proto.lost or proto.transport.is_closing():
                return Pending.later(lambda: run(keys, args))  # connects when awaited
            pending = proto.send(("EVALSHA", sha, len(keys), *keys, *args), self.timeout_s)
            pending.on_noscript = lambda: self.execute("EVAL", text, len(keys), *keys, *args)
            return pending

        run.start = start
        return run

    async def _connect(self) -> _RespProtocol:
        connecting = self._connecting
        if connecting is None:  # one connect at a time; concurrent callers share it
            connecting = self._connecting = asyncio.ensure_future(self._open())
            connecting.add_done_callback(self._connect_done)
        return await asyncio.shield(connecting)

    def _connect_done(self, fut: asyncio.Future) -> None:
        # Cleared when the connect ends, even with every caller cancelled meanwhile: a
        # finished one is never handed out later (a lost connection, a stale error).
        if self._connecting is fut:
            self._connecting = None
        if not fut.cancelled():
            fut.exception()  # retrieved: a failure with no caller left is not logged

    async def _open(self) -> _RespProtocol:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(_RespProtocol, self.host, self.port), self.timeout_s
            )
        except (OSError, asyncio.TimeoutError) as e:
            raise ConnectionError(f"Redis {self.host}:{self.port}: {e!r}") from e
        try:
            if self.password is not None:
                auth = (self.username, self.password) if self.username else (self.password,)
                await proto.call(("AUTH", *auth), self.timeout_s)
            if self.db:
                await proto.call(("SELECT", self.db), self.timeout_s)
        except BaseException:
            proto.transport.close()
            raise
        self._proto = proto
        return proto

    async def aclose(self) -> None:
        if self._proto is not None:
            self._proto.transport.close()
            self._proto = None


class _RespProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiters: deque[asyncio.Future] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    async def call(self, args: tuple, timeout_s: float):
        return (await self.call_many([args], timeout_s))[0]

    def send(self, args: tuple, timeout_s: float) -> Pending:
        """Write one command now; its reply is awaited later (`Pending`)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.waiters.append(fut)
        self.transport.write(hiredis.pack_command(args))
        return Pending(fut, loop.call_later(timeout_s, self._expire, fut))

    async def call_many(self, commands: list[tuple], timeout_s: float) -> list:
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in commands]
        self.waiters.extend(futs)
        self.transport.write(b"".join(hiredis.pack_command(c) for c in commands))
        timer = loop.call_later(timeout_s, self._expire, futs[-1])
        try:
            replies = [await f for f in futs]
        finally:
            timer.cancel()
        for reply in replies:
            if isinstance(reply, hiredis.ReplyError):
                raise ResponseError(str(reply))
        return replies

    def _expire(self, fut: asyncio.Future) -> None:
        if not fut.done():
            fut.set_exception(TimeoutError("Redis did not answer in time"))
            self.transport.abort()  # the replies still due would answer the wrong waiters

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            fut = self.waiters.popleft()
            if not fut.done():  # a caller that gave up (cancelled, timed out) skips its reply
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(ConnectionError(f"Redis connection lost: {exc!r}"))


class Pending:
    """A command already written to Redis: `await` it once for its reply (errors as
    `LeanRedis.execute` raises them), or `cancel()` it if it will not be awaited (its reply
    is then skipped). Lets a caller do other work while Redis answers."""

    def __init__(self, fut: asyncio.Future | None, timer: asyncio.TimerHandle | None):
        self._fut, self._timer = fut, timer
        self._later = None  # `later`: a coroutine function run when awaited
        self.on_noscript = None  # EVALSHA: the EVAL to run if Redis lacks the script

    @classmethod
    def later(cls, make) -> Pending:
        """Nothing sent yet: `make()` runs when awaited (e.g. it must connect first)."""
        p = cls(None, None)
        p._later = make
        return p

    def __await__(self):
        return self._reply().__await__()

    async def _reply(self):
        if self._later is not None:
            return await self._later()
        try:
            reply = await self._fut
        finally:
            self._timer.cancel()
        if isinstance(reply, hiredis.ReplyError):
            if self.on_noscript is not None and str(reply).startswith("NOSCRIPT"):
                return await self.on_noscript()
            raise ResponseError(str(reply))
        return reply

    def cancel(self) -> None:
        if self._fut is not None:
            self._timer.cancel()
            self._fut.cancel()


def lean_client(url: str, timeout_s: float) -> LeanRedis | None:
    """A `LeanRedis` for a plain `redis://host:port[/db]` URL (user and password allowed);
    None for any other (TLS, unix sockets, query options) or without hiredis."""
    u = urlsplit(url)
    if hiredis is None or u.scheme != "redis" or u.query or not u.hostname:
        return None
    path = u.path.strip("/")
    if path and not path.isdigit():
        return None
    return LeanRedis(u.hostname, u.port or 6379, int(path or 0),
                     unquote(u.username) if u.username else None,
                     unquote(u.password) if u.password is not None else None,
                     timeout_s)  # fmt: skip

"""A streamed request outlives its decode node: the relay, and migration when the node fails.

The router asks each decode node for the token ids of every streamed event
(`X-Pdserve-Token-Ids: 1`); the node puts them in an SSE comment line at the head of the
event (node/resume.py), which `StreamRelay` strips before the client sees the event. Only
the raw lines are kept while the stream is healthy (a slice per event); they are parsed
when a migration needs them.

When the node fails mid-stream (the connection drops or times out, the node dies, the
stream carries an error event, or it ends without `[DONE]`), the router resubmits the
request to another decode node as a continuation: the same body with
`kv_transfer_params.resume` = per unfinished choice the tokens it streamed and the
characters of text the client has. The node takes prompt + those tokens as its prompt
(its KV comes like any prompt's: a prefill node over the normal PD path, or the new node's
own prefix cache / the KV store), shrinks `max_tokens`, and goes on; seeded sampling
continues exactly (engine/request.py `position_seed`), and the text goes on at the
client's character (a UTF-8 character or a stop string across the boundary). The
continuation's final usage chunk is rewritten to count the original prompt once and every
choice's tokens once. At most `max_migrations` per request, within `request_timeout_s` of
its start; past either, the client gets the error event and `[DONE]` as before.
Each migration is logged with the request id and counted by the path its KV took
(`pdserve_router_migrations{path}`: prefill_node, prefix_cache, store, local), with the gap
the client saw (last bytes before the failure to first bytes after). The path is the one
the new node reports with its first token (a `: kv <prefill path> <cached tokens>` comment
line after the `ids` line, node/resume.py); the one the router expected when it chose the
node only where no report came (a continuation that failed before its first token).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from pdserve.api.protocol import ErrorInfo, ErrorResponse
from pdserve.router.nodes import NodeState
from pdserve.router.relay import (
    DONE,
    NODE_ERRORS,
    AttemptFailed,
    NodeAnswer,
    OpenStream,
    decode_event,
    encode_body,
    open_stream,
)
from pdserve.router.selector import Decision
from pdserve.router.streamed import Release

logger = logging.getLogger(__name__)

IDS = b": ids "
KV = b": kv "
TOKEN_IDS_HEADER = "X-Pdserve-Token-Ids"


@dataclass
class StreamContext:
    """What a continuation needs to be sent again: the node body (a dict), its path, the
    prompts' tokens, the tenant salt, the request id and its first attempt number. Choice
    `i` is sample `i % n` of prompt `i // n`, as a node numbers them."""

    path: str
    body: dict
    prompts: list[list[int]]
    salt: str
    rid: str
    attempt: int
    include_usage: bool
    n: int
    excluded: set[str] = field(default_factory=set)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def prompt_tokens(self) -> int:
        """The usage's prompt tokens: each prompt counted once (node/openai_responses.py)."""
        return sum(map(len, self.prompts))


class StreamRelay:
    """One streamed request's relay across the decode nodes that serve it in turn."""

    def __init__(self, serving, ctx: StreamContext):
        self.serving = serving
        self.ctx = ctx
        self.start = time.monotonic()
        self._lines: list[bytes] = []  # raw `ids` comment lines not parsed yet
        self.ids: dict[int, list[int]] = {}  # per choice: every token streamed
        self.chars: dict[int, int] = {}  # per choice: text characters the client has
        self.finished: set[int] = set()
        self.migrations = 0
        self.done = False  # `[DONE]` seen
        self.error: bytes | None = None  # the error event that ended a node's stream
        # what router/stream_watch.py looks at: the node stream being read, its node, and
        # when its last bytes came
        self.reading: OpenStream | None = None
        self.node: NodeState | None = None
        self.last_read = self.start
        self.kv_path: str | None = None  # the current node's report (`: kv` line)

    async def relay(self, s: OpenStream, release: Release) -> AsyncIterator[bytes]:
        """The held events, then the rest of the node's stream, across migrations. Events
        that arrived together leave together (one write)."""
        gap_from: float | None = None
        path = ""
        watch = self.serving.watch
        watch.relays.add(self)
        try:
            while True:
                failure = "ended the stream early"
                self.reading, self.node = s, release.d.decode
                self.last_read = time.monotonic()
                try:
                    for events in _reads(s):
                        out = self._pass(events)
                        if out:
                            if gap_from is not None:
                                self._migrated(path, time.monotonic() - gap_from)
                                gap_from = None
                            yield out
                        if self.error is not None:
                            failure = f"sent an error: {self.error[6:200]!r}"
                            break
                    else:
                        async for data in s.rest:
                            self.last_read = time.monotonic()
                            out = self._pass(s.splitter.feed(data))
                            if out:
                                if gap_from is not None:
                                    self._migrated(path, time.monotonic() - gap_from)
                                    gap_from = None
                                yield out
                            if self.error is not None:
                                failure = f"sent an error: {self.error[6:200]!r}"
                                break
                except NODE_ERRORS as e:
                    failure = f"broke: {type(e).__name__}: {e}"
                self.reading = None
                if self.done:
                    return
                node = release.d.decode
                logger.warning("request %s: stream from %s %s", self.ctx.rid, node.url, failure)
                if gap_from is not None:  # a continuation that failed before its first bytes
                    self.serving.metrics.child(self.serving.metrics.migrations, path).inc()
                s.close()
                release.all()
                if self.error is None or b"engine_dead" in self.error:
                    node.breaker.record_failure()
                self.ctx.excluded.add(node.url)
                self._absorb()
                if len(self.finished) == self.ctx.choices:  # only its [DONE] was lost
                    yield DONE
                    return
                gap_from = gap_from or time.monotonic()
                nxt = await self._migrate()
                if nxt is None:
                    yield self._error_event(failure)
                    yield DONE
                    return
                s, release, path = nxt
                self.error, self.kv_path = None, None
        finally:
            watch.relays.discard(self)
            s.close()
            release.all()

    # -- events -----------------------------------------------------------------------------
    def _pass(self, events: list[bytes]) -> bytes:
        """The events to relay: `ids` lines kept aside and stripped, the usage chunk kept
        only if asked (rewritten after a migration); stops at an error event."""
        kept = []
        for e in events:
            if e.startswith(IDS):
                i = e.index(b"\n")
                self._lines.append(e[6:i])
                e = e[i + 1 :]
                if e.startswith(KV):
                    i = e.index(b"\n")
                    self.kv_path = self.kv_path or kv_path(e[5:i])
                    e = e[i + 1 :]
                if e == b"\n":
                    continue
            if e == DONE:
                self.done = True
                kept.append(e)
                continue
            chunk = decode_event(e)
            if chunk is not None:
                if chunk.error is not None:
                    self.error = e
                    break
                if not chunk.choices and chunk.usage is not None:
                    details = chunk.usage.prompt_tokens_details
                    self.serving.metrics.actual_hit_tokens.inc(
                        details.cached_tokens if details else 0
                    )
                    if not self.ctx.include_usage:
                        continue
                    if self.migrations:
                        e = self._usage(e)
            kept.append(e)
        return b"".join(kept)

    def _absorb(self) -> None:
        """Parse the `ids` lines seen so far: `<index> <chars> <finished> <id> ...`."""
        for line in self._lines:
            index, chars, finished, *ids = line.split()
            i = int(index)
            self.ids.setdefault(i, []).extend(map(int, ids))
            self.chars[i] = int(chars)
            if finished == b"1":
                self.finished.add(i)
        self._lines.clear()

    def _usage(self, event: bytes) -> bytes:
        """The continuation's usage chunk, counting the original prompt once and every
        choice's tokens once (the continuation's node saw the streamed ones as prompt)."""
        self._absorb()
        body = msgspec.json.decode(event[6:].strip())
        completion = sum(map(len, self.ids.values()))
        prompt = self.ctx.prompt_tokens
        body["usage"].update(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def _error_event(self, failure: str) -> bytes:
        if self.error is not None:
            return self.error
        err = ErrorResponse(
            error=ErrorInfo(
                message=f"the node serving this request failed: {failure}",
                type="server_error",
                code="upstream_error",
            )
        )
        return f"data: {err.model_dump_json()}\n\n".encode()

    # -- migration ----------------------------------------------------------------------------
    async def _migrate(self) -> tuple[OpenStream, Release, str] | None:
        """Open the continuation on another decode node: (stream, its accounting, path), or
        None when no node, no migration or no time is left."""
        cfg = self.serving.config
        self._absorb()
        unfinished = [i for i in range(self.ctx.choices) if i not in self.finished]
        deadline = self.start + cfg.request_timeout_s
        while unfinished and self.migrations < cfg.max_migrations:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.migrations += 1
            first = unfinished[0]  # the nodes are chosen on it, as on prompt 0 at first
            tokens = self.ctx.prompts[first // self.ctx.n] + self.ids.get(first, [])
            d = await self.serving.selector.select(tokens, self.ctx.excluded, self.ctx.salt)
            if d is None:
                break
            path = _path(d)
            try:
                opened, release = await asyncio.wait_for(self._open(d, unfinished), left)
            except (AttemptFailed, asyncio.TimeoutError) as e:
                logger.warning("request %s: continuation on %s failed: %s",
                               self.ctx.rid, d.decode.url, e)  # fmt: skip
                self.ctx.excluded.add(d.decode.url)
                continue
            logger.warning(
                "request %s migrated (%d) to decode %s (expected via %s): %s tokens resumed",
                self.ctx.rid, self.migrations, d.decode.url, path,
                "/".join(str(len(self.ids.get(i, []))) for i in unfinished),
            )  # fmt: skip
            return opened, release, path
        return None

    async def _open(self, d: Decision, unfinished: list[int]) -> tuple[OpenStream, Release]:
        body = dict(self.ctx.body)  # `echo` stays: the node counts text offsets after it
        body.pop("prompt_logprobs", None)
        kv: dict = {
            "resume": [
                {"index": i, "token_ids": self.ids.get(i, []), "text_chars": self.chars.get(i, 0)}
                for i in unfinished
            ]
        }
        if d.prefill is not None:
            kv["prefill_node"] = d.prefill.record.kv_control
        body["kv_transfer_params"] = kv
        headers = {
            "X-Request-Id": self.ctx.rid,
            "X-Attempt": str(self.ctx.attempt + self.migrations),
            "Content-Type": "application/json",
            TOKEN_IDS_HEADER: "1",
        }
        node = d.decode
        node.breaker.on_dispatch()
        node.inflight += 1
        node.inflight_blocks += d.prompt_blocks
        if d.prefill is not None:
            d.prefill.prefill_blocks += d.prompt_blocks
        release = Release(d)
        try:
            opened = await open_stream(node, self.ctx.path, encode_body(body), headers, 0)
        except AttemptFailed as e:
            release.all()
            if e.node_fault:
                node.breaker.record_failure()
            raise
        except BaseException:
            release.all()
            raise
        release.prefill_done()
        if isinstance(opened, NodeAnswer):
            release.all()
            raise AttemptFailed("status", f"{node.url} refused the continuation: "
                                f"{opened.content[:200]!r}", node_fault=False)  # fmt: skip
        node.breaker.record_success()
        return opened, release

    def _migrated(self, expected: str, gap_s: float) -> None:
        """The continuation's first bytes: count the migration by the path its node
        reported (else the one expected) and observe the gap the client saw."""
        path = self.kv_path or expected
        m = self.serving.metrics
        m.child(m.migrations, path).inc()
        m.child(m.migration_gap, path).observe(gap_s)
        logger.info("request %s: %.3f s between tokens across the migration; KV via %s "
                    "(expected %s)", self.ctx.rid, gap_s, path, expected)  # fmt: skip


def _reads(s: OpenStream):
    """The events already held when the stream opened (one read's worth)."""
    if s.held:
        held, s.held = s.held, []
        yield held


def _path(d: Decision) -> str:
    """Where the continuation's KV is expected from: a prefill node, the new decode node's
    own prefix cache or its KV store (the router's index does not tell them apart), or
    computed there."""
    if d.prefill is not None:
        return "prefill_node"
    return "prefix_cache" if d.predicted_hit_tokens > 0 else "local"


def kv_path(line: bytes) -> str | None:
    """The path of a node's `: kv <prefill path> <cached tokens>` line (from a node: any
    other content gives None, and the expected path is used)."""
    parts = line.split()
    if len(parts) != 2 or not parts[1].isdigit():
        return None
    prefill = parts[0].decode("ascii", "replace")
    if prefill == "remote":
        return "prefill_node"
    if prefill == "store_hit":
        return "store"
    if not prefill.startswith("local_"):  # local_policy, local_transfer_failed, ...
        return None
    return "prefix_cache" if int(parts[1]) > 0 else "local"

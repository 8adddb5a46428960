"""The prefill side of a push connector: take orders, WRITE blocks, end every attempt.

Each attempt `(request_id, attempt)` is in one `SendState`:

    COMPUTING --finish()---------------------------> FINISHING --last WRITE DONE--> gone (SendDone)
    COMPUTING, FINISHING --AbortPrefill / a WRITE failed / end() / deadline--> ENDING
    COMPUTING, FINISHING --the lease lapsed with WRITEs in flight (all stopped)--> ENDING
    ENDING --no WRITE in flight--> gone (SendFailed; AbortAck or PrefillFailed to decode)
    any state --deadline + grace--> gone (SendFailed; pending WRITEs stopped)

Time is this host's monotonic clock only: an order's deadline is its `ttl_s` counted from
when the control pump received it. Immediately before posting any WRITE the side reads
the control channel (an abort that arrived during a step ends the attempt first) and
checks that the deadline has not passed and that the connection's lease from the decode
node runs (`PrefillControl.lease_until`); without a lease the WRITE waits (bounded by
the deadline), so a decode node that fenced the connection knows when the last WRITE
could have been posted, and a WRITE still in flight when the lease lapses is cancelled
(`kv_transfer/prefill_send.py`). The decode node hears of an early end as soon as nothing
of the attempt is in flight (`PrefillFailed`/`AbortAck`), so it releases at once; when a
WRITE of it ended FAILED (stopped or failed: its data may still move) the message names
the decode agent's epoch it went to (`unsettled_epoch`), and the decode node drops that
agent's connections first.

Peers are validated and bounded by liveness (`kv_transfer/decode_peers.py`): a
`PeerHello` whose layout does not match ours marks that peer bad (its orders are
rejected with the reason), and every order passes `order_problem` (block
ids in range and unique, counts that match the prompt, a sane deadline) before the
engine sees it. A malformed frame with a readable (request_id, attempt) is rejected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import torch

from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.base import (
    NewOrder,
    OrderAborted,
    PrefillConnector,
    PrefillEvent,
    SendDone,
    SendFailed,
    TransferKey,
)
from pdserve.kv_transfer.decode_peers import DecodePeers
from pdserve.kv_transfer.order_check import MAX_ORDER_TTL_S, order_problem
from pdserve.kv_transfer.prefill_send import SendState, _Send
from pdserve.kv_transfer.transfer_types import (
    DataPlane,
    DataPlaneOwner,
    TransferState,
    WarmupTimedOut,
)

logger = logging.getLogger(__name__)

MAX_TOMBSTONES = 100_000  # aborts of orders not seen yet, remembered until their deadline


class PrefillSide(DataPlaneOwner, PrefillConnector):
    needs_lease = True  # posts WRITE into the peer (False: LMCache stores to a shared store)

    def __init__(
        self,
        control,
        data_factory: Callable[[torch.Tensor], DataPlane],
        *,
        grace_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`control`: a `PrefillControl` (or the simulator's); `data_factory(kv_cache)`
        builds the data plane on `register_kv_cache`."""
        self.control = control
        self._data_factory = data_factory
        self.data: DataPlane | None = None
        self.grace_s = grace_s
        self.clock = clock
        self._sends: dict[TransferKey, _Send] = {}
        self.peers = DecodePeers(lambda: self._data, control)
        self._tombstones: dict[TransferKey, float] = {}  # aborted before seen -> until
        self.steps = 0  # engine steps seen (polls), carried by heartbeat answers
        self._next_expiry = float("-inf")  # of idle decode peers
        self._events: list[PrefillEvent] = []
        self.lapsed_cancels = 0  # attempts whose WRITEs in flight a lapsed lease cancelled
        self.write_stops = 0  # `DataPlane.stop_writes` calls (each stops every connection's)

    @property
    def control_address(self) -> str:
        return self.control.address

    # -- calls from the prefill role -----------------------------------------------------
    def send_blocks(self, key: TransferKey, src_block_ids: list[int], first_index: int) -> None:
        s = self._sends.get(key)
        if s is None or s.state is not SendState.COMPUTING or not src_block_ids:
            return
        src, dst = self._map(s, src_block_ids, first_index)
        s.blocks_sent += len(src)
        s.hash_sent(self.kv_cache, src)
        s.deferred.append((src, dst))
        self._post_deferred(key, s)

    def _may_post(self, key: TransferKey, s: _Send) -> bool:
        """Just before posting: read aborts that came meanwhile, check the deadline and
        the connection's lease (without one, posts wait)."""
        self._events += self._read_control()
        self._cancel_lapsed()
        if s.state is SendState.ENDING or key not in self._sends:
            return False
        now = self.clock()
        if now > s.deadline:
            self._end(key, s, "the order expired before its WRITEs")
            return False
        return not self.needs_lease or now < self.control.lease_until(s.ident)

    def _post_deferred(self, key: TransferKey, s: _Send) -> None:
        while s.deferred and self._may_post(key, s):
            src, dst = s.deferred.pop(0)
            if not self._post(key, s, src, dst, None):
                return

    def _post(self, key, s: _Send, src: list[int], dst: list[int], notif: bytes | None) -> bool:
        epoch = self.peers.epochs.get(s.order.decode_agent, 0)
        if self.peers.hello_epochs.get(s.ident, 0) != epoch:
            # the decode node fenced its data plane after this connection's hello: the
            # agent it meant is gone, and its blocks may be reused once this connection's
            # lease ends, which nothing sent to the new agent would respect
            self._end(key, s, "the decode node dropped its KV connections since the order")
            return False
        try:
            s.handles.append(self._data.write_blocks(s.order.decode_agent, src, dst, notif))
            s.epoch = epoch
        except ValueError as e:  # e.g. the peer was dropped meanwhile
            self._end(key, s, f"cannot post a WRITE: {e}")
            return False
        return True

    def finish(
        self,
        key,
        src_block_ids,
        first_index,
        first_token,
        logprob,
        prefill_node_s=(0.0, 0.0),
        top=None,
        prompt_logprobs=None,
    ) -> None:
        s = self._sends.get(key)
        if s is None or s.state is not SendState.COMPUTING:
            return
        src, dst = self._map(s, src_block_ids, first_index)
        s.hash_sent(self.kv_cache, src)
        done = m.PrefillDone(
            request_id=key[0],
            attempt=key[1],
            first_token=first_token,
            logprob=logprob,
            num_blocks=s.blocks_sent + len(src),
            nonce=s.order.nonce,
            prefill_queue_s=prefill_node_s[0],
            prefill_compute_s=prefill_node_s[1],
            top=top,
            prompt_logprobs=prompt_logprobs,
            checksums=s.checksums if s.order.checksums else None,
        )
        s.final, s.state = (src, dst, done), SendState.FINISHING
        self._cancel_lapsed()
        self._events += self._progress(key, s)

    def end(self, key: TransferKey, reason: str) -> bool:
        """The engine dropped the attempt; False if it has ended here already."""
        s = self._sends.get(key)
        if s is None:
            return False
        if s.state is not SendState.ENDING:
            self._end(key, s, reason)
        return True

    def reject(self, order: m.PrefillOrder, reason: str) -> None:
        s = self._sends.pop((order.request_id, order.attempt), None)
        if s is not None:
            self.control.reply(s.ident, _rejected(order.request_id, order.attempt, reason))

    def _end(self, key: TransferKey, s: _Send, reason: str) -> None:
        logger.warning("request %s (attempt %d): prefill ends early: %s", *key, reason)
        if s.state is SendState.COMPUTING:
            self._events.append(OrderAborted(key, reason))
        s.state = SendState.ENDING
        if s.reply is None:
            s.reply = m.PrefillFailed(request_id=key[0], attempt=key[1], reason=reason)

    @staticmethod
    def _map(s: _Send, src: list[int], first_index: int) -> tuple[list[int], list[int]]:
        o = s.order
        start = first_index - o.first_block
        if start < 0 or start + len(src) > len(o.dst_block_ids):
            raise ValueError(f"request {o.request_id}: blocks outside the ordered range")
        return src, o.dst_block_ids[start : start + len(src)]

    # -- polling ---------------------------------------------------------------------------
    def _cancel_lapsed(self) -> None:
        """Cancel the WRITEs in flight on every connection whose lease lapsed (see
        `kv_transfer/prefill_send.py`); call before anything progresses NIXL."""
        if not self.needs_lease or self.data is None:
            return
        now = self.clock()
        lapsed = [
            (key, s) for key, s in self._sends.items()
            if now >= self.control.lease_until(s.ident) and s.pending
        ]  # fmt: skip
        if not lapsed:
            return
        self._stop_writes()
        for key, s in lapsed:
            self.lapsed_cancels += 1
            if s.state is not SendState.ENDING:
                self._end(key, s, "the lease lapsed with WRITEs in flight (cancelled)")

    def _stop_writes(self) -> None:
        """Stop every WRITE in flight (`DataPlane.stop_writes`: releasing one does not
        stop its data). Every attempt with a WRITE in flight then sees it FAILED and ends
        (its decode node prefills locally); the lapsed ones are ended by the caller."""
        now = self.clock()
        for s in self._sends.values():
            if s.pending:  # what the network carries may still land: no end message yet
                s.quiet_until = now + self.grace_s
        stopped = self._data.stop_writes()
        self.write_stops += 1
        logger.warning("stopped %d WRITE(s) in flight on every connection", stopped)

    def poll(self) -> list[PrefillEvent]:
        self._cancel_lapsed()
        events, self._events = self._events, []
        if self.data is not None:
            for agent, problem in self.data.progress_warmups():
                # A warm-up that only ran out of time (the decode loop was busy) is not the
                # peer failing: it stays, and its first WRITE finishes the connection.
                if problem is not None and not isinstance(problem, WarmupTimedOut):
                    if any(
                        s.pending and s.order.decode_agent == agent for s in self._sends.values()
                    ):
                        self._stop_writes()  # removing the peer would not stop its WRITEs
                    self.peers.failed(agent, problem)
        events += self._read_control()
        now = self.clock()
        for key, until in list(self._tombstones.items()):
            if now > until:
                del self._tombstones[key]
        if self.data is not None and now >= self._next_expiry:
            self._next_expiry = now + 1.0
            busy = {s.ident for s in self._sends.values()}
            self.peers.expire(now, busy, {s.order.decode_agent for s in self._sends.values()})
        for key, s in list(self._sends.items()):
            if now > max(s.deadline + self.grace_s, s.quiet_until):
                events += self._close(key, s, "the order's deadline and grace passed")
                continue
            if now > s.deadline and not s.final_posted and s.state is not SendState.ENDING:
                self._end(key, s, "the order expired before it finished")
            events += self._progress(key, s)
        events, self._events = events + self._events, []
        self.steps += 1  # this loop's progress, with whether it holds work
        self.control.progress(self.steps, bool(self._sends))
        return events

    def _read_control(self) -> list[PrefillEvent]:
        events: list[PrefillEvent] = []
        for ident, msg, at in self.control.recv_timed():
            try:
                events += self._on_message(ident, msg, at)
            except Exception:  # a bug met by one peer message: reject it, keep serving
                logger.exception("control message %s from a peer failed", type(msg).__name__)
                if isinstance(msg, m.PrefillOrder):
                    key = (msg.request_id, msg.attempt)
                    self._sends.pop(key, None)
                    self.control.reply(ident, _rejected(*key, "internal error"))
        return events

    def _on_message(self, ident: bytes, msg, at: float) -> list[PrefillEvent]:
        if isinstance(msg, m.MalformedMessage):
            if msg.key is not None:
                self.control.reply(ident, _rejected(*msg.key, f"malformed message: {msg}"))
            return []
        if isinstance(msg, m.PeerHello):
            busy = {s.ident for s in self._sends.values()}
            self.peers.hello(ident, msg.agent_metadata, busy, msg.epoch)
        elif isinstance(msg, m.PrefillOrder):
            return self._on_order(ident, msg, at)
        elif isinstance(msg, m.AbortPrefill):
            key = (msg.request_id, msg.attempt)
            s = self._sends.get(key)
            if s is None or s.ident != ident:
                if s is None and len(self._tombstones) < MAX_TOMBSTONES:
                    ttl = min(max(msg.ttl_s, 0.0), MAX_ORDER_TTL_S)  # the order may still come
                    self._tombstones[key] = at + ttl
                self.control.reply(ident, m.AbortAck(request_id=key[0], attempt=key[1]))
            else:
                s.reply = m.AbortAck(request_id=key[0], attempt=key[1])
                if s.state is not SendState.ENDING:
                    self._end(key, s, "aborted by the decode node")
        return []

    def _on_order(self, ident: bytes, order: m.PrefillOrder, at: float) -> list[PrefillEvent]:
        key = (order.request_id, order.attempt)
        if ident in self.peers.refused:
            self.control.reply(ident, _rejected(*key, self.peers.refused[ident]))
            return []
        if self.peers.agents.get(ident) != order.decode_agent:
            hello = _rejected(*key, "unknown decode agent")
            hello.need_hello = True
            self.control.reply(ident, hello)
            return []
        problem = order_problem(
            order,
            block_size=self._data.layout.block_size,
            peer_num_blocks=self._data.peer_layout(order.decode_agent).num_blocks,
        )
        if problem is None and key in self._sends:
            problem = "duplicate (request id, attempt)"
        if problem is None and key in self._tombstones:
            problem = "aborted before the order arrived"
        if problem is not None:
            logger.warning("request %s (attempt %d): order rejected: %s", *key, problem)
            self.control.reply(ident, _rejected(*key, problem))
            return []
        self._sends[key] = _Send(order, ident, deadline=at + order.ttl_s)
        waited = max(0.0, self.clock() - at)  # unread while the engine was in a step
        return [NewOrder(order, waited)]

    def _progress(self, key: TransferKey, s: _Send) -> list[PrefillEvent]:
        t = self._data
        if s.deferred and s.state is not SendState.ENDING:
            self._post_deferred(key, s)
        states = [t.poll(h) for h in s.handles]
        s.unsettled = s.unsettled or TransferState.FAILED in states
        if TransferState.FAILED in states and s.state is not SendState.ENDING:
            self._end(key, s, "a block WRITE to the decode node failed")
        if s.state is SendState.ENDING:
            if TransferState.PENDING in states or self.clock() < s.quiet_until:
                return []  # wait for in-flight writes; bounded by the deadline + grace
            if s.unsettled:  # the decode node fences its agent of that epoch first
                s.reply = msgspec.structs.replace(s.reply, unsettled_epoch=s.epoch)
            self.control.reply(s.ident, s.reply)
            return self._close(key, s, s.reply.reason if hasattr(s.reply, "reason") else "aborted")
        if s.state is SendState.FINISHING and not s.final_posted:
            if s.deferred or any(x is not TransferState.DONE for x in states):
                return []
            if not self._may_post(key, s):  # aborted, past its deadline, or no lease yet
                return self._progress(key, s) if s.state is SendState.ENDING else []
            src, dst, done = s.final
            s.final_posted = True
            if src:
                self._post(key, s, src, dst, self._sealed(done))
            else:
                try:
                    t.send_notif(s.order.decode_agent, self._sealed(done))
                except RuntimeError as e:
                    self._end(key, s, str(e))
                    return self._progress(key, s)
                return self._sent(key, s)
            return self._progress(key, s)
        if s.final_posted and t.poll(s.handles[-1]) is TransferState.DONE:
            return self._sent(key, s)
        return []

    def _sealed(self, done: m.PrefillDone) -> bytes:
        """The data-plane notification, sealed like a control frame (with a secret)."""
        return self.control.auth.seal(m.encode(done))

    def _sent(self, key: TransferKey, s: _Send) -> list[PrefillEvent]:
        nbytes = sum(h.stats.bytes for h in s.handles)
        descs = sum(h.stats.descriptors for h in s.handles)
        self._drop(key, s)
        secs = time.perf_counter() - s.started
        logger.info("request %s (attempt %d): pushed %d B in %.3f s", *key, nbytes, secs)
        return [SendDone(key, nbytes, descs, secs)]

    def _close(self, key: TransferKey, s: _Send, reason: str) -> list[PrefillEvent]:
        events: list[PrefillEvent] = []
        if s.state is SendState.COMPUTING:
            events.append(OrderAborted(key, reason))
        self._drop(key, s)
        return events + [SendFailed(key, reason)]

    def _drop(self, key: TransferKey, s: _Send) -> None:
        if s.pending:  # deadline and grace passed with WRITEs still moving: stop them
            self._stop_writes()
        for h in s.handles:
            self._data.release(h)
        del self._sends[key]

    def flush(self, timeout_s: float) -> None:
        """Drive NIXL until no WRITE is pending, for at most `timeout_s`: without a NIXL
        progress thread nothing moves while the engine computes, so a WRITE posted after
        a step (the first to a peer waits for the connection) would otherwise complete,
        and the decode node hear of it, only after the NEXT step."""
        self._cancel_lapsed()
        deadline = time.perf_counter() + timeout_s
        pending = [h for s in self._sends.values() for h in s.handles]
        delay = 1e-5
        while pending := [h for h in pending if self._data.poll(h) is TransferState.PENDING]:
            if time.perf_counter() >= deadline:
                return
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    # -- bookkeeping ---------------------------------------------------------------------
    def states(self) -> dict[TransferKey, SendState]:
        return {k: s.state for k, s in self._sends.items()}

    def wait_sockets(self) -> list:
        return self.control.sockets()

    def has_pending(self) -> bool:
        """Sends or events outstanding, or a new peer's warm-up to drive (so an idle loop
        keeps polling until it ends)."""
        warming = self.data is not None and self.data.num_warming > 0
        return bool(self._sends or self._events) or warming

    def check_integrity(self) -> None:
        if self.data is None:
            return
        self.data.check_integrity()
        tracked = sum(len(s.handles) for s in self._sends.values())
        if self.data.num_inflight != tracked:
            raise RuntimeError(f"{self.data.num_inflight} transfers in flight, {tracked} tracked")

    def close(self) -> None:
        for key, s in list(self._sends.items()):
            self._drop(key, s)
        self.control.close()
        if self.data is not None:
            self.data.close()


def _rejected(rid: str, attempt: int, reason: str) -> m.PrefillRejected:
    return m.PrefillRejected(request_id=rid, attempt=attempt, reason=reason)

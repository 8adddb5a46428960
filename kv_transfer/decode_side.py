"""The decode side of a push connector: order prefills, watch them end, release blocks.

Each attempt `(request_id, attempt)` is in one `RecvState`:

    ORDERED --PrefillDone (all blocks, checksums match)-------------> gone (RecvDone)
    ORDERED --rejected / failed / peer dead or stuck / deadline--> FAILED  (RecvFailed)
    ORDERED --cancel (client abort)-------------------------------> CANCELLED
    FAILED, CANCELLED --end message from the prefill node---------> gone (Released)
    FAILED, CANCELLED --no end within abort_grace_s, or peer dead--> FENCED
    any --its connection closed (fenced, evicted)-----------------> FENCED (RecvFailed
                                                                    if it was ORDERED)
    FENCED --the link's last lease ran out, plus abort_grace_s----> gone (Released)

Entering FENCED without an end message also fences the data plane
(`DataPlane.fence_incoming`: NIXL rebuilds the agent, dropping every incoming
connection), and so does an end message whose `unsettled_epoch` names the current agent (a
WRITE of the attempt was stopped or failed, its data perhaps still in the network), so
the blocks never wait on the network draining within a grace. `PeerHello.epoch` is the
count of those fences: a WRITE that failed because of one names an older epoch.

All times are this host's monotonic clock (`clock`); the order carries only a duration
(`ttl_s`), which the prefill node counts from its own receipt. Blocks are never reused on
"the deadline passed" alone: only an end message from the prefill node (`PrefillRejected`,
`PrefillFailed`, `AbortAck`, a late `PrefillDone`) proves no WRITE of the attempt will
land, or fencing does: the control connection is closed, so the prefill node's lease to
post WRITEs on it is not renewed, and once the last lease granted on it ran out (with
the clocks' rate bound) and `abort_grace_s` more (the prefill node cancels what is in
flight when its lease lapses, kv_transfer/prefill_send.py, and the data fence above drops
what the network still carries) nothing of it can land (`DecodeControl.fence`). An order
still in the local send queue when its attempt fails or is cancelled was never sent: it is withdrawn
and released at once. A message from another peer, or another connection, about the
attempt is ignored. The control channel and the data plane are passed in, so the same
logic runs over ZMQ + NIXL and over the seeded simulator's in-memory transport.
"""

from __future__ import annotations

import enum
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.base import (
    DecodeConnector,
    DecodeEvent,
    RecvDone,
    RecvFailed,
    Released,
    TransferKey,
)
from pdserve.kv_transfer.done_check import done_problem
from pdserve.kv_transfer.frame_auth import UnauthenticatedFrame
from pdserve.kv_transfer.kv_verify import corrupt_enabled, flip_bytes, mismatches
from pdserve.kv_transfer.transfer_types import DataPlane, DataPlaneOwner

logger = logging.getLogger(__name__)


class RecvState(enum.Enum):
    ORDERED = "ordered"
    FAILED = "failed"
    CANCELLED = "cancelled"
    FENCED = "fenced"


@dataclass
class _Attempt:
    node: str
    order: m.PrefillOrder
    deadline: float  # ORDERED until then (this clock)
    gen: int | None = None  # the control link it was ordered on
    state: RecvState = RecvState.ORDERED
    hello_resent: bool = False
    end_by: float = float("inf")  # FAILED/CANCELLED: fence if no end message by then
    release_at: float = float("inf")  # FENCED: released then


class DecodeSide(DataPlaneOwner, DecodeConnector):
    # The peer WRITEs into our blocks (NIXL): fence before reuse. False (LMCache: only our
    # own retrieve writes them, tracked by the subclass): a failed attempt is released
    # once its end-message wait is over, without fencing.
    peer_writes = True

    def __init__(
        self,
        control_factory: Callable[[Callable[[], m.PeerHello]], object],
        data_factory: Callable[[torch.Tensor], DataPlane],
        *,
        abort_grace_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`control_factory(hello)` builds the control channel (`DecodeControl` or a
        simulated one); `data_factory(kv_cache)` the data plane, on `register_kv_cache`."""
        self.control = control_factory(self._hello)
        self._data_factory = data_factory
        self.data: DataPlane | None = None
        self.abort_grace_s = abort_grace_s
        self.clock = clock
        self._attempts: dict[TransferKey, _Attempt] = {}
        self._events: list[DecodeEvent] = []
        self.num_data_fences = 0

    def _hello(self) -> m.PeerHello:
        return m.PeerHello(agent_metadata=self._data.local_metadata(), epoch=self.num_data_fences)

    # -- requests from the decode role ---------------------------------------------------
    def request_prefill(self, order: m.PrefillOrder, prefill_node: str) -> None:
        key = (order.request_id, order.attempt)
        order = msgspec.structs.replace(order, nonce=secrets.randbits(63))
        if not self.control.alive(prefill_node):
            self._events += [RecvFailed(key, f"prefill node {prefill_node} is not answering")]
            self._events.append(Released(key))
            return
        if not self.control.send(prefill_node, order, key):
            self._events += [RecvFailed(key, f"cannot send to prefill node {prefill_node}")]
            self._events.append(Released(key))
            return
        deadline = self.clock() + order.ttl_s
        gen = self.control.generation(prefill_node)
        self._attempts[key] = _Attempt(prefill_node, order, deadline, gen)
        logger.info(
            "request %s (attempt %d): prefill ordered from %s (%d blocks from block %d)",
            *key,
            prefill_node,
            len(order.dst_block_ids),
            order.first_block,
        )

    def cancel(self, key: TransferKey) -> None:
        att = self._attempts.get(key)
        if att is None or att.state is not RecvState.ORDERED:
            return
        att.state = RecvState.CANCELLED
        att.end_by = self.clock() + self.abort_grace_s
        self._stop(key, att)

    def peer_alive(self, prefill_node: str) -> bool:
        return self.control.alive(prefill_node)

    # -- polling ---------------------------------------------------------------------------
    def poll(self) -> list[DecodeEvent]:
        events, self._events = self._events, []
        if self.control.hello_missing:
            self._send_hellos()
        for agent, msgs in self._data.get_notifs().items():
            for raw in msgs:
                try:  # sealed by a holder of the cluster secret (a no-op without one)
                    raw = self.control.auth.open(raw, fresh=False)
                except UnauthenticatedFrame as e:
                    logger.warning("dropping a notification from %s: %s", agent, e)
                    continue
                try:
                    msg = m.decode_to_decode(raw)
                except m.MalformedMessage as e:
                    logger.warning("dropping a malformed notification: %s", e)
                    continue
                if isinstance(msg, m.PrefillDone):
                    events += self._on_done(agent, msg)
        for node, msg in self.control.recv():
            if not isinstance(msg, m.MalformedMessage):
                try:
                    events += self._on_control(node, msg)
                except Exception:  # a bug met by one peer message: drop it, keep serving
                    logger.exception("control message %s from %s failed", type(msg).__name__, node)
        self.control.tick({a.node for a in self._attempts.values()})
        return events + self._expire()

    def _expire(self, data_fenced: bool = False) -> list[DecodeEvent]:
        events: list[DecodeEvent] = []
        now, fence, fenced = self.clock(), set(), False
        for key, att in self._attempts.items():
            if att.state is RecvState.FENCED:
                continue
            until = self.control.closed_until(att.gen)
            if until is not None:  # its link is gone: no lease of it is renewed
                if att.state is RecvState.ORDERED:
                    events.append(RecvFailed(key, f"connection to {att.node} fenced"))
                grace = self.abort_grace_s if self.peer_writes else float("-inf")
                att.state, att.release_at = RecvState.FENCED, until + grace
                fenced = self.peer_writes
        if fenced and not data_fenced:  # before any of their blocks is released
            self._fence_data()
        for key, att in list(self._attempts.items()):
            if att.state is RecvState.FENCED:
                if now >= att.release_at:
                    del self._attempts[key]
                    events.append(Released(key))
                continue
            if att.state is RecvState.ORDERED:
                if now > att.deadline:
                    events += self._fail(key, att, f"no KV from {att.node} within the deadline")
                elif not self.control.alive(att.node):
                    why = "stuck" if self.control.stuck(att.node) else "not answering"
                    events += self._fail(key, att, f"prefill node {att.node} is {why}")
            if key in self._attempts and att.state is not RecvState.ORDERED:
                if not self.peer_writes and now > att.end_by:
                    del self._attempts[key]
                    events.append(Released(key))
                elif now > att.end_by or self.control.dead(att.node):
                    fence.add(att.node)  # no end message in time: stop its leases
        if fence and self.peer_writes:  # first: the new links' hellos name the new agent
            self._fence_data()
        for node in fence:
            self.control.fence(node)
        return events + (self._expire(data_fenced=True) if fence else [])

    def _fence_data(self) -> None:
        """An attempt was fenced without an end message: its peer may have WRITEs in the
        network, or in its kernel's buffers for a socket it closed, which a healed
        partition delivers long after the lease and the grace (tests/multihost/
        test_cancel.py). Drop every incoming data-plane connection before its blocks can
        be reused, so that none of it can land. Other peers' WRITEs in flight fail, and
        their attempts end; the new metadata goes to every connected peer."""
        self._data.fence_incoming()
        self.num_data_fences += 1
        self.control.hello_missing = True  # every link's hello names the dropped agent
        logger.warning("dropped every incoming KV connection (fence %d)", self.num_data_fences)

    def _send_hellos(self) -> None:
        try:
            hello = self._hello()
        except RuntimeError as e:  # the data plane is down (our link is): a later poll
            logger.debug("no hello yet: %s", e)
            return
        self.control.hello_all(hello)

    def _on_done(self, agent: str, msg: m.PrefillDone) -> list[DecodeEvent]:
        key = (msg.request_id, msg.attempt)
        att = self._attempts.get(key)
        if att is None:
            return []
        if msg.nonce != att.order.nonce:  # not from the node we ordered from
            logger.warning("request %s (attempt %d): ignoring a forged done from %s", *key, agent)
            return []
        del self._attempts[key]
        if att.state is not RecvState.ORDERED:  # every write landed: nothing more will
            return [Released(key)]
        expected = len(att.order.dst_block_ids)
        if msg.num_blocks != expected:
            reason = f"incomplete KV: {msg.num_blocks} of {expected} blocks"
            return [RecvFailed(key, reason), Released(key)]
        problem = done_problem(att.order, msg, self.vocab_size)
        if problem is not None:
            self.num_bad_dones += 1
            logger.warning(
                "request %s (attempt %d): bad done from prefill node %s (agent %s): %s",
                *key, att.node, agent, problem,
            )  # fmt: skip
            return [
                RecvFailed(key, f"bad done from the prefill node: {problem}"),
                Released(key),
            ]
        if self.peer_writes:  # every WRITE landed before this notification
            bad = self._verify(key, att, msg.checksums)
            if bad:
                return bad
        timing = (msg.prefill_queue_s, msg.prefill_compute_s)
        if not all(math.isfinite(x) and 0 <= x < 1e6 for x in timing):
            timing = (0.0, 0.0)  # only ever reported, so a bad value is just dropped
        return [
            RecvDone(
                key,
                msg.first_token,
                msg.logprob,
                msg.num_blocks,
                timing,
                top=msg.top,
                prompt_logprobs=msg.prompt_logprobs,
                checksums=msg.checksums,
            )
        ]

    def _verify(self, key: TransferKey, att: _Attempt, sums: list[int] | None) -> list[DecodeEvent]:
        """Hash the landed blocks against the sender's checksums, if the order asked
        (kv_transfer/kv_verify.py); a mismatch fails the attempt (every block landed, so
        its blocks are released at once)."""
        ids = att.order.dst_block_ids
        if not att.order.checksums or not ids or self.kv_cache is None:
            return []
        if corrupt_enabled():  # test hook: a corruption after the sender's hash
            flip_bytes(self.kv_cache, ids[0])
        bad = mismatches(self.kv_cache, ids, sums or [])
        if not bad:
            return []
        self.num_checksum_mismatches += 1
        logger.warning(
            "request %s (attempt %d): KV checksum mismatch from prefill node %s: "
            "%d of %d blocks differ (decode blocks %s)", *key, att.node, len(bad), len(ids),
            bad[:8],
        )  # fmt: skip
        reason = f"KV checksum mismatch from prefill node {att.node} ({len(bad)} blocks)"
        return [RecvFailed(key, reason, checksum_mismatch=True), Released(key)]

    def _on_control(self, node: str, msg: m.ToDecode) -> list[DecodeEvent]:
        if isinstance(msg, (m.PrefillDone, m.HeartbeatAck)):
            return []  # PrefillDone counts only as a data-plane notification
        key = (msg.request_id, msg.attempt)
        att = self._attempts.get(key)
        if att is None or att.node != node or att.state is RecvState.FENCED:
            return []  # stale, or another peer's word about a transfer it does not own
        if att.gen != self.control.generation(node):  # heard on another connection
            return []
        if (
            isinstance(msg, m.PrefillRejected) and msg.need_hello and not att.hello_resent
            and att.state is RecvState.ORDERED  # not once aborted: that order must not run
        ):  # fmt: skip
            att.hello_resent = True
            if self.control.send(node, self._hello()) and self.control.send(node, att.order, key):
                return []
        del self._attempts[key]
        if self.peer_writes and getattr(msg, "unsettled_epoch", -1) >= self.num_data_fences:
            # a WRITE of it was stopped or failed, its data perhaps still in the network
            # or in the prefill host's kernel for a socket it closed: the agent it went to
            # is dropped before the blocks are (one fence per attempt at most)
            logger.warning("request %s (attempt %d): %s ended with a WRITE unsettled", *key, node)
            self._fence_data()
        if att.state is not RecvState.ORDERED:
            return [Released(key)]
        reason = getattr(msg, "reason", "the prefill node ended the transfer")
        logger.warning("request %s (attempt %d): prefill node %s: %s", *key, node, reason)
        return [RecvFailed(key, f"prefill node {node}: {reason}"), Released(key)]

    def _fail(self, key: TransferKey, att: _Attempt, reason: str) -> list[DecodeEvent]:
        logger.warning("request %s (attempt %d): %s", *key, reason)
        att.state = RecvState.FAILED
        att.end_by = self.clock() + self.abort_grace_s
        released = self._stop(key, att)
        return [RecvFailed(key, reason)] + ([Released(key)] if released else [])

    def _stop(self, key: TransferKey, att: _Attempt) -> bool:
        """Stop the attempt at the prefill node; True if it never left (released now)."""
        if self.control.withdraw(att.node, key):
            del self._attempts[key]
            if att.state is RecvState.CANCELLED:
                self._events.append(Released(key))
            return True
        abort = m.AbortPrefill(request_id=key[0], attempt=key[1], ttl_s=att.order.ttl_s)
        self.control.send(att.node, abort)
        return False

    # -- bookkeeping ---------------------------------------------------------------------
    def states(self) -> dict[TransferKey, RecvState]:
        return {k: a.state for k, a in self._attempts.items()}

    def wait_sockets(self) -> list:
        return self.control.sockets()

    def has_pending(self) -> bool:
        return bool(self._attempts or self._events)

    def check_integrity(self) -> None:
        if self.data is not None:
            self.data.check_integrity()
            if self.data.num_inflight:
                raise RuntimeError(f"a decode side posted {self.data.num_inflight} WRITEs")

    def close(self) -> None:
        self.control.close()
        if self.data is not None:
            self.data.close()

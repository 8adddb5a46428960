"""The NIXL KV connector: prefill WRITEs paged blocks straight into the decode node's blocks.

Control messages (`kv_transfer.messages`) go over ZMQ: the prefill node binds a ROUTER at
its control address, each decode node connects a DEALER and introduces itself once with
its NIXL metadata (`PeerHello`), so afterwards only block ids travel per request. Data
goes over NIXL (`kv_transfer.nixl_transport`): blocks are pushed as chunks finish; the
request's last WRITE is posted only after every earlier one is DONE and carries
`PrefillDone` as its notification, so the decode node hears "done" only once all blocks
have landed. See `kv_transfer.base` for the contract and the deadline rules.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import torch
import zmq

from kv_transfer import messages as m
from kv_transfer.base import (
    KVConnector,
    KVEvent,
    NewOrder,
    OrderAborted,
    RecvDone,
    RecvFailed,
    Released,
    SendDone,
    SendFailed,
    register_connector,
)
from kv_transfer.nixl_transport import NixlTransport, TransferHandle, TransferState

logger = logging.getLogger(__name__)


@dataclass
class _Recv:  # decode side: one request waiting for its KV
    node: str
    order: m.PrefillOrder
    deadline: float
    hello_resent: bool = False


@dataclass
class _Send:  # prefill side: one order being computed and pushed
    order: m.PrefillOrder
    ident: bytes
    deadline: float
    handles: list[TransferHandle] = field(default_factory=list)
    blocks_sent: int = 0
    final: tuple[list[int], list[int], m.PrefillDone] | None = None
    final_handle: TransferHandle | None = None
    aborting: bool = False
    abort_reported: bool = False
    started: float = field(default_factory=time.perf_counter)


@register_connector("nixl")
class NixlConnector(KVConnector):
    def __init__(
        self,
        *,
        node_id: str,
        role: str,
        control_address: str | None = None,
        abort_grace_s: float = 2.0,
    ):
        if role not in ("prefill", "decode"):
            raise ValueError(f"NIXL connector role must be 'prefill' or 'decode', got {role!r}")
        self.role = role
        self.node_id = node_id
        self.abort_grace_s = abort_grace_s
        self._ctx = zmq.Context()
        self.transport: NixlTransport | None = None
        # decode side
        self._dealers: dict[str, zmq.Socket] = {}
        self._recv: dict[str, _Recv] = {}
        self._cancelled: dict[str, tuple[str, float]] = {}  # rid -> (node, release time)
        # prefill side
        self._router: zmq.Socket | None = None
        self._sends: dict[str, _Send] = {}
        self._events: list[KVEvent] = []  # produced outside poll(), returned by the next one
        if role == "prefill":
            if not control_address:
                raise ValueError("a prefill node needs a control address (kv control)")
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(control_address)
            self.control_address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            logger.info("prefill control channel on %s", self.control_address)

    # -- worker side ----------------------------------------------------------------------
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        name = f"{self.node_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # The engine loop polls every step, so no NIXL progress thread busy-spinning a core.
        self.transport = NixlTransport(name, kv_cache, progress_thread=False)

    def poll(self) -> list[KVEvent]:
        if self.role == "decode":
            return self._poll_decode()
        return self._poll_prefill()

    # -- decode side ----------------------------------------------------------------------
    def request_prefill(self, order: m.PrefillOrder, prefill_node: str) -> None:
        dealer = self._dealer(prefill_node)
        dealer.send(m.encode(order))
        self._recv[order.request_id] = _Recv(
            prefill_node, order, time.monotonic() + order.expires_in_s
        )
        logger.info(
            "request %s: prefill ordered from %s (%d blocks from block %d)",
            order.request_id,
            prefill_node,
            len(order.dst_block_ids),
            order.first_block,
        )

    def cancel(self, request_id: str) -> None:
        rec = self._recv.pop(request_id, None)
        if rec is not None:
            self._abort_remote(request_id, rec)

    def _abort_remote(self, rid: str, rec: _Recv) -> None:
        self._dealer(rec.node).send(m.encode(m.AbortPrefill(request_id=rid)))
        self._cancelled[rid] = (rec.node, rec.deadline + self.abort_grace_s)

    def _dealer(self, node: str) -> zmq.Socket:
        sock = self._dealers.get(node)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(node)
            sock.send(m.encode(m.PeerHello(agent_metadata=self._transport.local_metadata())))
            self._dealers[node] = sock
        return sock

    def _poll_decode(self) -> list[KVEvent]:
        events: list[KVEvent] = []
        now = time.monotonic()
        for msgs in self._transport.get_notifs().values():
            for raw in msgs:
                msg = m.decode_to_decode(raw)
                if isinstance(msg, m.PrefillDone):
                    events.extend(self._on_done(msg))
        for node, sock in self._dealers.items():
            while sock.poll(0):
                msg = m.decode_to_decode(sock.recv())
                rid = msg.request_id
                if isinstance(msg, m.PrefillRejected):
                    rec = self._recv.get(rid)
                    if rec is None:
                        continue
                    if msg.need_hello and not rec.hello_resent:
                        rec.hello_resent = True
                        hello = m.PeerHello(agent_metadata=self._transport.local_metadata())
                        sock.send(m.encode(hello))
                        sock.send(m.encode(rec.order))
                        continue
                    del self._recv[rid]
                    events += [
                        RecvFailed(rid, f"prefill node {node} rejected: {msg.reason}"),
                        Released(rid),
                    ]
                elif isinstance(msg, m.AbortAck) and self._cancelled.pop(rid, None) is not None:
                    events.append(Released(rid))
        for rid, rec in list(self._recv.items()):
            if now > rec.deadline:
                del self._recv[rid]
                self._abort_remote(rid, rec)
                events.append(
                    RecvFailed(
                        rid,
                        f"no KV from prefill node {rec.node} within {rec.order.expires_in_s:g} s",
                    )
                )
        for rid, (_, release_at) in list(self._cancelled.items()):
            if now > release_at:
                del self._cancelled[rid]
                events.append(Released(rid))
        return events

    def _on_done(self, msg: m.PrefillDone) -> list[KVEvent]:
        rid = msg.request_id
        rec = self._recv.pop(rid, None)
        if rec is None:
            # Done after we gave up: every write has landed, nothing more will come.
            return [Released(rid)] if self._cancelled.pop(rid, None) is not None else []
        expected = len(rec.order.dst_block_ids)
        if msg.num_blocks != expected:
            self._abort_remote(rid, rec)
            return [RecvFailed(rid, f"incomplete KV: {msg.num_blocks} of {expected} blocks")]
        return [RecvDone(rid, msg.first_token, msg.logprob, msg.num_blocks)]

    # -- prefill side ---------------------------------------------------------------------
    def send_blocks(self, request_id: str, src_block_ids: list[int], first_index: int) -> None:
        s = self._sends.get(request_id)
        if s is None or s.aborting or not src_block_ids:
            return
        src, dst = self._map(s, src_block_ids, first_index)
        s.handles.append(self._transport.write_blocks(s.order.decode_agent, src, dst))
        s.blocks_sent += len(src)

    def finish(
        self,
        request_id: str,
        src_block_ids: list[int],
        first_index: int,
        first_token: int,
        logprob: float | None,
    ) -> None:
        s = self._sends.get(request_id)
        if s is None or s.aborting:
            return
        src, dst = self._map(s, src_block_ids, first_index)
        done = m.PrefillDone(
            request_id=request_id,
            first_token=first_token,
            logprob=logprob,
            num_blocks=s.blocks_sent + len(src),
        )
        s.final = (src, dst, done)
        self._events.extend(self._progress(request_id, s))  # post now; report on next poll

    def settle_abort(self, request_id: str) -> None:
        s = self._sends.get(request_id)
        if s is not None:
            s.aborting = s.abort_reported = True

    @staticmethod
    def _map(s: _Send, src: list[int], first_index: int) -> tuple[list[int], list[int]]:
        o = s.order
        start = first_index - o.first_block
        if start < 0 or start + len(src) > len(o.dst_block_ids):
            raise ValueError(
                f"request {o.request_id}: prompt blocks {first_index}..{first_index + len(src)} "
                f"outside the ordered range {o.first_block}..{o.first_block + len(o.dst_block_ids)}"
            )
        return src, o.dst_block_ids[start : start + len(src)]

    def _poll_prefill(self) -> list[KVEvent]:
        events, self._events = self._events, []
        assert self._router is not None
        while self._router.poll(0):
            ident, raw = self._router.recv_multipart()
            try:
                msg = m.decode_to_prefill(raw)
            except Exception as e:  # a malformed frame is dropped, never executed
                logger.warning("dropping a malformed control message: %s", e)
                continue
            if isinstance(msg, m.PeerHello):
                name = self._transport.add_peer(msg.agent_metadata)
                logger.info("decode peer %s introduced itself", name)
            elif isinstance(msg, m.PrefillOrder):
                events.extend(self._on_order(ident, msg))
            elif isinstance(msg, m.AbortPrefill):
                s = self._sends.get(msg.request_id)
                if s is None:
                    self._reply(ident, m.AbortAck(request_id=msg.request_id))
                elif not s.abort_reported:
                    s.abort_reported = True
                    events.append(OrderAborted(msg.request_id))
        now = time.monotonic()
        for rid, s in list(self._sends.items()):
            if now > s.deadline and not s.abort_reported and s.final_handle is None:
                logger.warning("request %s: prefill order expired before it finished", rid)
                s.abort_reported = True
                events.append(OrderAborted(rid))
            events.extend(self._progress(rid, s))
        return events

    def _on_order(self, ident: bytes, order: m.PrefillOrder) -> list[KVEvent]:
        rid = order.request_id
        if order.decode_agent not in self._transport.peers:
            self._reply(
                ident,
                m.PrefillRejected(request_id=rid, reason="unknown decode agent", need_hello=True),
            )
            return []
        if rid in self._sends:
            self._reply(ident, m.PrefillRejected(request_id=rid, reason="duplicate request id"))
            return []
        self._sends[rid] = _Send(order, ident, time.monotonic() + order.expires_in_s)
        return [NewOrder(order)]

    def reject(self, order: m.PrefillOrder, reason: str) -> None:
        """The prefill node cannot run this order (bad input, full): tell the decode node."""
        s = self._sends.pop(order.request_id, None)
        if s is not None:
            self._reply(s.ident, m.PrefillRejected(request_id=order.request_id, reason=reason))

    def _progress(self, rid: str, s: _Send) -> list[KVEvent]:
        t = self._transport
        states = [t.poll(h) for h in s.handles]
        failed = TransferState.FAILED in states or (
            s.final_handle is not None and t.poll(s.final_handle) is TransferState.FAILED
        )
        if s.aborting or failed:
            pending = [
                h
                for h in s.handles + [s.final_handle]
                if h is not None and h.state is TransferState.PENDING
            ]
            if pending and not failed:
                return []  # wait for in-flight writes to settle before acknowledging
            self._close_send(rid, s)
            if s.aborting:
                self._reply(s.ident, m.AbortAck(request_id=rid))
            reason = "aborted" if s.aborting else "a block write to the decode node failed"
            return [SendFailed(rid, reason)]
        if (
            s.final is not None
            and s.final_handle is None
            and all(x is TransferState.DONE for x in states)
        ):
            src, dst, done = s.final
            if src:
                s.final_handle = t.write_blocks(
                    s.order.decode_agent, src, dst, notif=m.encode(done)
                )
            else:
                t.send_notif(s.order.decode_agent, m.encode(done))
                return self._sent(rid, s)
        if s.final_handle is not None and t.poll(s.final_handle) is TransferState.DONE:
            return self._sent(rid, s)
        return []

    def _sent(self, rid: str, s: _Send) -> list[KVEvent]:
        handles = s.handles + ([s.final_handle] if s.final_handle else [])
        nbytes = sum(h.stats.bytes for h in handles)
        descs = sum(h.stats.descriptors for h in handles)
        self._close_send(rid, s)
        secs = time.perf_counter() - s.started
        logger.info(
            "request %s: pushed %d blocks, %d B in %d descriptors, %.3f s",
            rid,
            s.final[2].num_blocks,
            nbytes,
            descs,
            secs,
        )
        return [SendDone(rid, nbytes, descs, secs)]

    def _close_send(self, rid: str, s: _Send) -> None:
        for h in s.handles + ([s.final_handle] if s.final_handle else []):
            self._transport.release(h)
        del self._sends[rid]

    def _reply(self, ident: bytes, msg: m.ToDecode) -> None:
        assert self._router is not None
        self._router.send_multipart([ident, m.encode(msg)])

    # -- both -----------------------------------------------------------------------------
    @property
    def _transport(self) -> NixlTransport:
        if self.transport is None:
            raise RuntimeError("register_kv_cache() must be called first")
        return self.transport

    @property
    def local_name(self) -> str:
        return self._transport.name

    def wait_sockets(self) -> list[zmq.Socket]:
        if self._router is not None:
            return [self._router]
        return list(self._dealers.values())

    def has_pending(self) -> bool:
        return bool(self._recv or self._cancelled or self._sends or self._events)

    def check_integrity(self) -> None:
        if self.transport is not None:
            self.transport.check_integrity()
        tracked = sum(len(s.handles) + (s.final_handle is not None) for s in self._sends.values())
        if self.transport is not None and self.transport.num_inflight != tracked:
            raise RuntimeError(
                f"{self.transport.num_inflight} transfers in flight, {tracked} tracked by requests"
            )

    def close(self) -> None:
        for sock in self._dealers.values():
            sock.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        for rid, s in list(self._sends.items()):
            self._close_send(rid, s)
        if self.transport is not None:
            self.transport.close()
        self._ctx.term()

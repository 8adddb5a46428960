"""The prefill node's control socket, pumped by its own thread so heartbeats never wait.

A prefill node's engine thread reads the control channel only between engine steps; a
long step (a big prompt chunk, a slow GPU kernel) would leave decode nodes' heartbeats
unanswered and make them declare this node dead. `ControlPump` owns the bound ZMQ ROUTER
in a daemon thread that

* reads every incoming frame at once and passes it to `screen(ident, raw, send)`
  (`PrefillControl._screen`: checks the frame's seal and answers a `Heartbeat` itself
  through `send`); what `screen` returns (an opened, non-heartbeat payload) goes on to
  the engine thread over an inproc PAIR socket, with the time the pump received it
  (`clock`, so an order's deadline counts from its arrival, not from when a long step
  let the engine read it);
* sends out the engine thread's replies, which arrive over the same PAIR.

So the ROUTER is used by the pump thread only, and the engine thread sees one PAIR
socket (`socket`, which its poller waits on) with the link calls `PrefillControl`
expects (`recv`, `send`, `close`). A SIGSTOPped or dead process answers nothing (the thread stops with
it), so decode nodes still detect that within their `peer_timeout_s`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)

Screen = Callable[[bytes, bytes, Callable[[bytes, bytes], None]], bytes | None]
INNER_HWM = 100_000  # frames queued for the engine thread (a long step) before drops
# The largest frame a peer may send (a prefill order of a ~1M-token prompt fits): ZMQ drops
# the connection of a peer that sends more, so the queue above never holds huge frames.
MAX_FRAME_BYTES = 8 << 20


class ControlPump:
    screened = True  # frames from `recv` were already opened by `screen`

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        screen: Screen,
        curve: tuple[bytes, bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`curve`: this node's CURVE (public, secret) key pair: clients must know the
        public key, and everything on the connection is encrypted."""
        self._screen = screen
        self._clock = clock
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if curve is not None:
            self._router.curve_server = True
            self._router.curve_publickey, self._router.curve_secretkey = curve
        self._router.bind(address)
        self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        inproc = f"inproc://pdserve-control-{uuid.uuid4().hex}"
        self._inner = ctx.socket(zmq.PAIR)  # the pump's end
        self.socket = ctx.socket(zmq.PAIR)  # the engine thread's end
        for s in (self._inner, self.socket):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, INNER_HWM)
            s.setsockopt(zmq.RCVHWM, INNER_HWM)
        self._inner.bind(inproc)
        self.socket.connect(inproc)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-control-pump", daemon=True)
        self._thread.start()

    # -- the engine thread's side ----------------------------------------------------------
    def recv(self) -> list[bytes] | None:
        return self.socket.recv_multipart() if self.socket.poll(0) else None

    def send(self, ident: bytes, frame: bytes) -> None:
        try:
            self.socket.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the decode node's deadline covers a dropped reply
            logger.warning("control reply dropped: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.socket.close(linger=0)

    # -- the pump thread -------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._inner, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self._router in ready:
                    self._pump_in()
                if self._inner in ready:
                    while self._inner.poll(0):
                        ident, frame = self._inner.recv_multipart()
                        self._send_out(ident, frame)
        except Exception:  # never silently: decode nodes will see this node as dead
            logger.exception("the control pump thread failed")
        finally:
            self._router.close(linger=0)
            self._inner.close(linger=0)

    def _pump_in(self) -> None:
        while self._router.poll(0):
            frames = self._router.recv_multipart()
            if len(frames) != 2:
                logger.warning("dropping a control message of %d frames", len(frames))
                continue
            ident, raw = frames
            at = repr(self._clock()).encode()
            try:
                payload = self._screen(ident, raw, self._send_out)
            except Exception:  # one bad frame must not stop the pump
                logger.exception("screening a control frame failed")
                continue
            if payload is None:
                continue
            try:
                self._inner.send_multipart([ident, payload, at], zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("engine thread %d frames behind; dropping one", INNER_HWM)

    def _send_out(self, ident: bytes, frame: bytes) -> None:
        try:  # unroutable or full: dropped; the decode node's deadline covers it
            self._router.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("control reply dropped: %s", e)

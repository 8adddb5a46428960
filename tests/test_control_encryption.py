"""The KV control channel is encrypted with a cluster secret (CurveZMQ, keys derived from
the secret): a relay on the wire between a decode and a prefill node (real ZMQ, real TCP)
records every byte; an order's request id and prompt token ids cross in the clear without
a secret and never with one, while the prefill side still reads the order intact."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import messages as m
from pdserve.kv_transfer.control_channel import DecodeControl, PrefillControl
from pdserve.kv_transfer.frame_auth import FrameAuth
from tests.servers import free_port

SECRET = b"encryption-test-secret-0123456789"
MARKER = "request-id-a-sniffer-wants-to-see"


class Relay:
    """A TCP relay on loopback that keeps a copy of everything it forwards."""

    def __init__(self, target_port: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        self.seen = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self.lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("secret", [None, SECRET])
def test_orders_cross_the_wire_encrypted(secret):
    port = free_port()
    pc = PrefillControl(f"tcp://127.0.0.1:{port}", auth=FrameAuth(secret))
    relay = Relay(port)
    dc = DecodeControl(lambda: m.PeerHello(agent_metadata=b"md"), auth=FrameAuth(secret))
    order = m.PrefillOrder(
        request_id=MARKER,
        attempt=0,
        prompt_token_ids=[70000 + i for i in range(64)],
        params=SamplingParams(max_tokens=1),
        decode_agent="d",
        first_block=0,
        dst_block_ids=[1, 2, 3, 4],
        ttl_s=60.0,
    )
    try:
        node = f"tcp://127.0.0.1:{relay.port}"
        assert dc.send(node, order)
        got, deadline = [], time.monotonic() + 60
        while not any(isinstance(msg, m.PrefillOrder) for _, msg in got):
            assert time.monotonic() < deadline, "the order never arrived"
            dc.tick(set())
            got += pc.recv()
            time.sleep(0.02)
        received = next(msg for _, msg in got if isinstance(msg, m.PrefillOrder))
        assert received == order  # intact through the relay
        with relay.lock:
            wire = bytes(relay.seen)
        tokens = m.encode(order.prompt_token_ids)  # msgpack of the prompt, as encoded
        if secret is None:  # the control check: a sniffer reads everything
            assert MARKER.encode() in wire and tokens in wire
        else:
            assert MARKER.encode() not in wire and tokens not in wire
            assert b"CURVE" in wire  # the ZMTP greeting names the mechanism
    finally:
        dc.close()
        pc.close()
        relay.close()

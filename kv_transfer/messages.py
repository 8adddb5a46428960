"""The PD control protocol between a decode node and a prefill node (msgpack, no pickle).

Decode -> prefill, over ZMQ (decode's DEALER to prefill's ROUTER), in order:
  `PeerHello` (decode's NIXL metadata, once per connection), `PrefillOrder`, `AbortPrefill`.
Prefill -> decode, over the same ZMQ connection:
  `PrefillRejected` (cannot take the order; `need_hello` asks for `PeerHello` first),
  `AbortAck` (nothing more will be written into that request's blocks).
Prefill -> decode, as the NIXL notification of the request's last block WRITE, so it is
delivered only after every block has landed:
  `PrefillDone` (first sampled token and number of blocks written).
"""

from __future__ import annotations

import msgspec

from engine.sampling_params import SamplingParams


class PeerHello(msgspec.Struct, tag=True, kw_only=True):
    agent_metadata: bytes


class PrefillOrder(msgspec.Struct, tag=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # the prefill node samples the first token with these
    decode_agent: str
    first_block: int  # decode already holds blocks [0, first_block) (its prefix cache)
    dst_block_ids: list[int]  # decode blocks for prompt blocks first_block, first_block+1, ...
    expires_in_s: float  # the prefill node writes nothing after this long from receipt


class AbortPrefill(msgspec.Struct, tag=True, kw_only=True):
    request_id: str


class PrefillRejected(msgspec.Struct, tag=True, kw_only=True):
    request_id: str
    reason: str
    need_hello: bool = False


class AbortAck(msgspec.Struct, tag=True, kw_only=True):
    request_id: str


class PrefillDone(msgspec.Struct, tag=True, kw_only=True):
    request_id: str
    first_token: int
    logprob: float | None
    num_blocks: int  # blocks written for this request, all transfers together


ToPrefill = PeerHello | PrefillOrder | AbortPrefill
ToDecode = PrefillRejected | AbortAck | PrefillDone

_enc = msgspec.msgpack.Encoder()
_to_prefill = msgspec.msgpack.Decoder(ToPrefill)
_to_decode = msgspec.msgpack.Decoder(ToDecode)


def encode(msg: ToPrefill | ToDecode) -> bytes:
    return _enc.encode(msg)


def decode_to_prefill(data: bytes) -> ToPrefill:
    return _to_prefill.decode(data)


def decode_to_decode(data: bytes) -> ToDecode:
    return _to_decode.decode(data)

"""The PD control protocol between a decode node and a prefill node (msgpack, no pickle).

Decode -> prefill, over the control channel (decode's DEALER to prefill's ROUTER):
  `PeerHello` (decode's data-plane metadata, once per connection), `PrefillOrder`,
  `AbortPrefill`, `Heartbeat` (while anything is outstanding with that prefill node).
Prefill -> decode, over the same connection:
  `PrefillRejected` (the order was not taken; nothing was or will be written;
  `need_hello` asks for `PeerHello` first), `PrefillFailed` (the prefill ended early:
  a WRITE failed, the order expired, the prefill node dropped it), `AbortAck` (answer to
  `AbortPrefill`), `HeartbeatAck` (with the prefill engine's progress, and the prefill
  node's own clock reading that a `LeaseGrant` hands back).
Decode -> prefill, in answer to each `HeartbeatAck`: `LeaseGrant`.
Prefill -> decode, as the data-plane notification of the request's last block WRITE, so
it is delivered only after every block has landed:
  `PrefillDone` (first sampled token, number of blocks written and, when the order asked,
  the first token's top logprobs, the prompt's logprobs and each written block's checksum).

Every per-request message names the transfer by (request_id, attempt): a retried request
never meets its earlier attempt. A prefill node sends `PrefillRejected`, `PrefillFailed`
or `AbortAck` only once none of that attempt's WRITEs is in flight: each one proves that
nothing more will land, so the decode node may reuse the blocks at once.

Time: no field is a timestamp compared across hosts. `PrefillOrder.ttl_s` is a duration;
each side counts it on its own monotonic clock from its own event (decode: sending;
prefill: receiving, so the prefill node's deadline falls later), and the prefill node
posts no WRITE after its deadline. The decode node never reuses an attempt's blocks on
time alone: only after an end message from the prefill node, or after fencing the
connection. Fencing rests on a lease the prefill node holds per connection: it posts
WRITEs only while the lease runs (`lease_until = at + for_s` on its own clock, where `at`
is its own reading sent in the `HeartbeatAck` the grant answers, so the lease starts
before the decode node granted it). A decode node fences a connection by closing it:
no grant follows, and once `for_s` (stretched by the clocks' rate bound) plus the WRITE
flight bound has passed on its clock since its last grant, nothing of that connection
can land (`DecodeControl.fence`).
"""

from __future__ import annotations

import msgspec

from pdserve.engine.outputs import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams


class PeerHello(msgspec.Struct, tag=True, kw_only=True):
    agent_metadata: bytes
    # how many times the decode node has fenced its data plane (each fence: a new agent,
    # new metadata); end messages name the epoch of the agent their WRITEs went to
    epoch: int = 0


class PrefillOrder(msgspec.Struct, tag=True, kw_only=True):
    request_id: str
    attempt: int
    prompt_token_ids: list[int]
    params: SamplingParams  # the prefill node samples the first token with these
    decode_agent: str
    first_block: int  # decode already holds blocks [0, first_block) (its prefix cache)
    dst_block_ids: list[int]  # decode blocks for prompt blocks first_block, first_block+1, ...
    ttl_s: float  # the prefill node writes nothing later than this after receiving it
    nonce: int = 0  # set by the decode side; PrefillDone must echo it
    checksums: bool = False  # the done carries each written block's checksum (verified)


class AbortPrefill(msgspec.Struct, tag=True, kw_only=True):
    request_id: str
    attempt: int
    ttl_s: float  # the order's: an order arriving after its abort is refused this long


class Heartbeat(msgspec.Struct, tag=True, kw_only=True):
    seq: int


class LeaseGrant(msgspec.Struct, tag=True, kw_only=True):
    """The prefill node may post WRITEs on this connection until `at + for_s` on its own
    clock (`at`: its reading from the `HeartbeatAck` this answers)."""

    at: float
    for_s: float


class PrefillRejected(msgspec.Struct, tag=True, kw_only=True):
    request_id: str
    attempt: int
    reason: str
    need_hello: bool = False


class PrefillFailed(msgspec.Struct, tag=True, kw_only=True):
    request_id: str
    attempt: int
    reason: str
    # >= 0: a WRITE of the attempt did not end DONE (stopped, failed), the last posted to
    # the decode agent of this epoch; its data may still be in the network (decode_side)
    unsettled_epoch: int = -1


class AbortAck(msgspec.Struct, tag=True, kw_only=True):
    request_id: str
    attempt: int
    unsettled_epoch: int = -1  # as PrefillFailed's


class HeartbeatAck(msgspec.Struct, tag=True, kw_only=True):
    seq: int
    at: float = 0.0  # the prefill node's monotonic clock when it answered (for LeaseGrant)
    steps: int = 0  # engine steps the prefill node has run (its loop's progress)
    busy: bool = False  # its engine holds work (so `steps` must advance)


class PrefillDone(msgspec.Struct, tag=True, kw_only=True):
    request_id: str
    attempt: int
    first_token: int
    logprob: float | None
    num_blocks: int  # blocks written for this attempt, all transfers together
    nonce: int = 0  # the order's: a notification from anyone else is ignored
    # The prefill node's share of the time to first token (its clock, so durations only):
    # order received -> first scheduled, first scheduled -> first token sampled.
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    # What the order's params asked for, computed in the prompt's own forward pass:
    # the first token's top alternatives (`top_logprobs`) and the prompt's logprobs
    # (`prompt_logprobs`: one entry per prompt token after the first). The decode side
    # checks their counts against its order (`kv_transfer.done_check`).
    top: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # When the order asked: xxh3_64 of each written block (engine/kv_checksum.py), in the
    # order of the order's `dst_block_ids`; the decode node hashes what landed and compares.
    checksums: list[int] | None = None


ToPrefill = PeerHello | PrefillOrder | AbortPrefill | Heartbeat | LeaseGrant
ToDecode = PrefillRejected | PrefillFailed | AbortAck | HeartbeatAck | PrefillDone

_enc = msgspec.msgpack.Encoder()
_to_prefill = msgspec.msgpack.Decoder(ToPrefill)
_to_decode = msgspec.msgpack.Decoder(ToDecode)


class MalformedMessage(ValueError):
    """A control frame that does not decode; `key` is its (request_id, attempt) if readable,
    so the sender can still be told the order was rejected."""

    def __init__(self, error: str, key: tuple[str, int] | None):
        super().__init__(error)
        self.key = key


def encode(msg: ToPrefill | ToDecode) -> bytes:
    return _enc.encode(msg)


def decode_to_prefill(data: bytes) -> ToPrefill:
    """Decode a frame from a decode node; raises `MalformedMessage` (never runs code)."""
    try:
        return _to_prefill.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise MalformedMessage(str(e), _readable_key(data)) from None


def decode_to_decode(data: bytes) -> ToDecode:
    try:
        return _to_decode.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise MalformedMessage(str(e), _readable_key(data)) from None


def _readable_key(data: bytes) -> tuple[str, int] | None:
    try:
        raw = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, ValueError):
        return None
    if isinstance(raw, dict):
        rid, attempt = raw.get("request_id"), raw.get("attempt")
        if isinstance(rid, str) and isinstance(attempt, int) and not isinstance(attempt, bool):
            return rid[:256], attempt
    return None

"""The ZMQ protocol between a node's HTTP frontend and its EngineCore process.

Two one-way channels, each a stream of msgpack-encoded, tagged msgspec structs:

- input (frontend -> engine): `AddRequest`, `AbortRequests`, `GetStats`, `CheckIntegrity`,
  `GetCachedHashes`, `Shutdown`. The engine handles them between steps, in arrival order.
- output (engine -> frontend): `Ready` once the model is loaded, then `OutputBatch` after
  every step that produced something (and after aborts), `UtilityResult` answering a
  `GetStats`/`CheckIntegrity` by its `call_id`, and `EngineDead` if the loop crashed.

Nothing is pickled: decoding is typed, so a malformed frame raises instead of running code.
"""

from __future__ import annotations

import msgspec

from pdserve.engine.outputs import EngineCoreOutput, EngineStats
from pdserve.engine.sampling_params import SamplingParams

# -- frontend -> engine -------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    remote_prefill: str | None = None  # decode role: the prefill node's control address


class AbortRequests(msgspec.Struct, tag=True, kw_only=True):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag=True, kw_only=True):
    call_id: int


class CheckIntegrity(msgspec.Struct, tag=True, kw_only=True):
    call_id: int


class GetCachedHashes(msgspec.Struct, tag=True, kw_only=True):
    """Every block hash in the prefix cache (the node rebuilds its KV index entry)."""

    call_id: int


class Shutdown(msgspec.Struct, tag=True):
    pass


EngineInput = AddRequest | AbortRequests | GetStats | CheckIntegrity | GetCachedHashes | Shutdown

# -- engine -> frontend -------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, kw_only=True):
    """Sent once, after the model is loaded: what the frontend needs to validate requests."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_blocks: int
    weights_digest: str = ""  # pdserve/common/weights_digest.py: the block-hash root's key


class OutputBatch(msgspec.Struct, tag=True, kw_only=True):
    outputs: list[EngineCoreOutput]
    stats: EngineStats
    # With `cache.kv_events`: block hashes that entered / left the prefix cache, in order.
    kv_stored: list[bytes] = msgspec.field(default_factory=list)
    kv_evicted: list[bytes] = msgspec.field(default_factory=list)
    # With `cache.kv_events` and a KV store: block hashes the store now holds.
    kv_store_saved: list[bytes] = msgspec.field(default_factory=list)


class RequestState(msgspec.Struct, kw_only=True):
    """One unfinished request of the engine, as `/debug/engine` shows it."""

    request_id: str
    queue: str  # compiling_grammar | running | waiting | waiting_for_kv | loading_from_store
    status: str
    prompt_tokens: int
    computed_tokens: int
    output_tokens: int
    max_tokens: int | None
    age_s: float
    remote_prefill: str | None = None


class UtilityResult(msgspec.Struct, tag=True, kw_only=True):
    call_id: int
    stats: EngineStats | None = None
    error: str | None = None  # CheckIntegrity: the violated invariant, None when it holds
    requests: list[RequestState] | None = None  # CheckIntegrity: every unfinished request
    cached_hashes: list[bytes] | None = None  # GetCachedHashes


class EngineDead(msgspec.Struct, tag=True, kw_only=True):
    error: str


EngineOutput = Ready | OutputBatch | UtilityResult | EngineDead


class InputCodec:
    """msgpack encoder/decoder for the input channel."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineInput)

    def encode(self, msg: EngineInput) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> EngineInput:
        return self._decoder.decode(data)


class OutputCodec:
    """msgpack encoder/decoder for the output channel."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineOutput)

    def encode(self, msg: EngineOutput) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> EngineOutput:
        return self._decoder.decode(data)


class EngineAddresses(msgspec.Struct, frozen=True, kw_only=True):
    """ZMQ endpoints of the two channels; the frontend binds both, the engine connects."""

    input: str
    output: str

    @classmethod
    def from_base(cls, base: str) -> EngineAddresses:
        """`ipc:///path/name` -> `…name-input`/`…name-output`; `tcp://host:P` -> ports P, P+1.
        The channels carry no authentication: a node refuses tcp:// (node/cli.py)."""
        if base.startswith("ipc://"):
            return cls(input=f"{base}-input", output=f"{base}-output")
        if base.startswith("tcp://"):
            host, _, port = base[len("tcp://") :].rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"engine address {base!r} must look like tcp://HOST:PORT")
            return cls(input=f"tcp://{host}:{port}", output=f"tcp://{host}:{int(port) + 1}")
        raise ValueError(f"engine address {base!r} must start with ipc:// or tcp://")

"""Typed results crossing the engine boundary, and the one fold of them into a request's output.

`EngineCoreOutput` (a msgspec struct: it travels over ZMQ) is what one step produced for
one request. `OutputStream` folds a request's engine outputs into `RequestDelta`s, each
with its detokenized text (stop strings applied); `RequestOutput.add` folds deltas into
the whole output. `LLM` uses both, `AsyncLLM` streams the deltas, the node folds them
into each choice's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from pdserve.engine.detokenizer import IncrementalDetokenizer


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One position's log-probabilities: the token there (sampled or from the prompt) first,
    then the most likely tokens, best first. Log-softmax of the raw logits."""

    token_ids: list[int]
    logprobs: list[float]


class RequestTimings(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Where a request's time to first token went inside the engine(s), in seconds.

    Sent once, with the request's first token. A locally prefilled request has `queue`
    and `prefill`; a PD request `decode_admission` (arrival -> prefill order sent),
    `prefill_queue` and `prefill_compute` (measured on the prefill node), `kv_transfer`
    (order sent -> done received, minus the prefill node's two: the order's trip, the last
    WRITEs and the done notification) and `first_decode_step` (done received -> token out).
    A PD request prefilled here after its remote prefill failed has `decode_admission`,
    `queue` (order sent -> scheduled here) and `prefill`.
    """

    queue_s: float | None = None
    prefill_s: float | None = None
    decode_admission_s: float | None = None
    prefill_queue_s: float | None = None
    prefill_compute_s: float | None = None
    kv_transfer_s: float | None = None
    first_decode_step_s: float | None = None
    # Where the prompt was prefilled and why (`PREFILL_PATHS`); not a stage.
    prefill: str | None = None

    def stages(self) -> dict[str, float]:
        """Stage name (without `_s`) -> seconds, in request order, for the stages present."""
        return {
            f.removesuffix("_s"): v
            for f in self.__struct_fields__
            if f.endswith("_s") and (v := getattr(self, f)) is not None
        }


# `RequestTimings.prefill`: remote (a prefill node computed it), local_policy (computed
# here by choice: no prefill node named, or a suffix short enough), local_transfer_failed
# / local_checksum_mismatch (computed here after the remote transfer failed / its blocks
# failed their checksums), store_hit (its prefix loaded from the KV store, the rest here).
PREFILL_PATHS = (
    "remote",
    "local_policy",
    "local_transfer_failed",
    "local_checksum_mismatch",
    "store_hit",
)


class EngineCoreOutput(msgspec.Struct, kw_only=True):
    """What one step produced for one request.

    `new_top_logprobs` (when the request asked for `top_logprobs`) has one entry per new
    token. `prompt_logprobs` comes once, with the first new token: one entry per prompt
    token after the first.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    timings: RequestTimings | None = None  # with the first token only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineStats(msgspec.Struct, kw_only=True):
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    generated_tokens: int
    engine_steps: int = 0  # loop iterations so far: a busy engine whose count stalls is stuck
    # PD roles (0 on a colocated node)
    num_waiting_for_kv: int = 0  # decode: admitted, blocks held, KV not yet arrived
    kv_blocks_held: int = 0  # blocks kept out of circulation until transfers settle
    grammars_compiling: int = 0  # requests waiting for their grammar (off the loop)
    pd_remote_prefills: int = 0  # decode: prefills ordered from prefill nodes
    pd_failures: int = 0  # decode: remote prefills that failed or timed out
    pd_bad_dones: int = 0  # decode: PrefillDones from a peer that failed their checks
    kv_bytes_received: int = 0  # decode
    kv_poison_violations: int = 0  # decode, PDSERVE_KV_POISON=1: WRITEs after release
    kv_checksum_mismatches: int = 0  # decode: transfers whose blocks failed their checksums
    kv_data_fences: int = 0  # decode: incoming KV connections all dropped (a peer fenced)
    # requests by where their prompt was prefilled (`PREFILL_PATHS`), at their first token
    prefill_paths: dict[str, int] = msgspec.field(default_factory=dict)
    pd_orders: int = 0  # prefill: orders taken
    kv_bytes_sent: int = 0  # prefill
    # KV store (0 without one): prompt tokens loaded from it and used, jobs, failures
    kv_store_hit_tokens: int = 0
    kv_store_loads: int = 0
    kv_store_load_failures: int = 0
    kv_store_saves: int = 0
    kv_store_save_failures: int = 0
    kv_store_fallbacks: int = 0  # loads passed to the next backend after one failed
    kv_store_checksum_mismatches: int = 0  # loads cut short: a block failed its checksum


@dataclass(slots=True)
class RequestDelta:
    """What one request produced since its previous delta."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[TokenLogprobs] | None = None  # per token, when top_logprobs > 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # once: prompt tokens 1..
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0
    ttft_s: float | None = None  # set on the delta carrying the first token
    itl_s: list[float] = field(default_factory=list)  # gaps between later token arrivals
    timings: RequestTimings | None = None  # engine-side TTFT stages, with the first token


class OutputStream:
    """One request's engine outputs, folded into deltas.

    `add` folds an output into the pending delta (a slow reader gets several merged);
    `take` closes it: its text is what the detokenizer can send now, and a stop string in
    it ends the request (`finish_reason` "stop"; `stopped_early` when the engine had not
    finished it, so the caller aborts it there).
    """

    def __init__(self, detokenizer: IncrementalDetokenizer | None, logprobs: bool):
        self.detokenizer = detokenizer
        self.logprobs = logprobs
        self.num_output_tokens = 0
        self.stopped_early = False
        self._pending: RequestDelta | None = None

    def add(self, out: EngineCoreOutput) -> None:
        d = self._pending
        if d is None:
            d = self._pending = RequestDelta([], "", logprobs=[] if self.logprobs else None)
        d.token_ids.extend(out.new_token_ids)
        if out.timings is not None:
            d.timings = out.timings
        if d.logprobs is not None and out.new_logprobs:
            d.logprobs.extend(out.new_logprobs)
        if out.new_top_logprobs:
            d.top_logprobs = (d.top_logprobs or []) + out.new_top_logprobs
        if out.prompt_logprobs is not None:
            d.prompt_logprobs = out.prompt_logprobs
        d.num_prompt_tokens = out.num_prompt_tokens
        d.num_cached_tokens = out.num_cached_tokens
        d.finish_reason = out.finish_reason

    def take(self) -> RequestDelta:
        """The pending delta, detokenized (at least one `add` since the last `take`)."""
        d, self._pending = self._pending, None
        assert d is not None, "take() without an output added"
        self.num_output_tokens += len(d.token_ids)
        d.num_output_tokens = self.num_output_tokens
        detok = self.detokenizer
        if detok is not None:
            finished = d.finish_reason is not None
            d.text = detok.update(d.token_ids, final=finished)
            if detok.stopped:
                self.stopped_early = not finished
                d.finish_reason = "stop"
        return d


@dataclass
class RequestOutput:
    """Everything one request (one choice) produced: the deltas folded by `add`."""

    request_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.. (token 0 has none)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    ttft_s: float | None = None  # arrival -> first token, where it was measured
    timings: RequestTimings | None = None

    def add(self, delta: RequestDelta) -> None:
        if delta.ttft_s is not None:
            self.ttft_s = delta.ttft_s
        if delta.timings is not None:
            self.timings = delta.timings
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.top_logprobs:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs.extend(delta.top_logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finish_reason = delta.finish_reason
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens

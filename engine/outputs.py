"""Typed results crossing the engine boundary (msgspec structs: they travel over ZMQ)."""

from __future__ import annotations

import msgspec


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

    def stages(self) -> dict[str, float]:
        """Stage name (without `_s`) -> seconds, in request order, for the stages present."""
        return {
            f.removesuffix("_s"): v
            for f in self.__struct_fields__
            if (v := getattr(self, f)) is not None
        }


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
    # PD roles (0 on a colocated node)
    num_waiting_for_kv: int = 0  # decode: admitted, blocks held, KV not yet arrived
    kv_blocks_held: int = 0  # blocks kept out of circulation until transfers settle
    grammars_compiling: int = 0  # requests waiting for their grammar (off the loop)
    pd_remote_prefills: int = 0  # decode: prefills ordered from prefill nodes
    pd_failures: int = 0  # decode: remote prefills that failed or timed out
    kv_bytes_received: int = 0  # decode
    pd_orders: int = 0  # prefill: orders taken
    kv_bytes_sent: int = 0  # prefill
    # KV store (0 without one): prompt tokens loaded from it and used, jobs, failures
    kv_store_hit_tokens: int = 0
    kv_store_loads: int = 0
    kv_store_load_failures: int = 0
    kv_store_saves: int = 0
    kv_store_save_failures: int = 0
    kv_store_fallbacks: int = 0  # loads passed to the next backend after one failed

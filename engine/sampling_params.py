"""Per-request sampling parameters, validated at construction (the client boundary).

Every field a client can set has one rule in `FIELD_RULES`: numbers must be finite and in
range, integers must fit the wire types (msgpack and torch take at most 64 bits; counts
are capped at int32). A value outside its rule raises `InvalidRequestError` naming the
field, so it becomes a 400 at the HTTP frontend and never reaches the engine thread.
To add a sampling field: add it to `SamplingParams` and give it a rule here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from engine.errors import InvalidRequestError

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this temperature sampling is greedy: dividing logits by it would overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's limit)
MAX_STOP_STRINGS = 64  # OpenAI allows 4; a generous cap keeps per-token work bounded


@dataclass(frozen=True)
class FloatRule:
    lo: float
    hi: float
    lo_open: bool = False  # (lo, ...] instead of [lo, ...]
    optional: bool = False  # None allowed

    def check(self, name: str, v: object) -> None:
        if v is None and self.optional:
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InvalidRequestError(f"{name} must be a finite number, got {v!r}", name)
        low_ok = v > self.lo if self.lo_open else v >= self.lo
        if not (low_ok and v <= self.hi):
            lb = "(" if self.lo_open else "["
            raise InvalidRequestError(
                f"{name} must be in {lb}{self.lo:g}, {self.hi:g}], got {v}", name
            )


@dataclass(frozen=True)
class IntRule:
    lo: int
    hi: int
    optional: bool = False

    def check(self, name: str, v: object) -> None:
        if v is None and self.optional:
            return
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidRequestError(f"{name} must be an integer, got {v!r}", name)
        if not self.lo <= v <= self.hi:
            raise InvalidRequestError(f"{name} must be in [{self.lo}, {self.hi}], got {v}", name)


@dataclass(frozen=True)
class IntListRule:
    item: IntRule
    max_len: int

    def check(self, name: str, v: object) -> None:
        if not isinstance(v, list) or len(v) > self.max_len:
            raise InvalidRequestError(f"{name} must be a list of at most {self.max_len}", name)
        for x in v:
            self.item.check(name, x)


FIELD_RULES: dict[str, FloatRule | IntRule | IntListRule] = {
    "temperature": FloatRule(0.0, 100.0),
    "top_p": FloatRule(0.0, 1.0, lo_open=True),
    "top_k": IntRule(1, INT32_MAX, optional=True),
    "min_p": FloatRule(0.0, 1.0),
    "seed": IntRule(INT64_MIN, INT64_MAX, optional=True),
    "max_tokens": IntRule(1, INT32_MAX),
    "stop_token_ids": IntListRule(IntRule(0, INT32_MAX), max_len=1024),
    "top_logprobs": IntRule(0, MAX_LOGPROBS),
    "prompt_logprobs": IntRule(0, MAX_LOGPROBS, optional=True),
    "presence_penalty": FloatRule(-2.0, 2.0),
    "frequency_penalty": FloatRule(-2.0, 2.0),
    "repetition_penalty": FloatRule(0.0, 100.0, lo_open=True),
    "min_tokens": IntRule(0, INT32_MAX),
}
MAX_LOGIT_BIAS = 1024  # entries
LOGIT_BIAS_RULE = FloatRule(-100.0, 100.0)
TOKEN_ID_RULE = IntRule(0, INT32_MAX)


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick each next token, and when to stop.

    `temperature` below `GREEDY_TEMPERATURE` (0 included) is greedy. `top_k=None`,
    `top_p=1.0` and `min_p=0.0` disable their filters. `seed` makes one request's sampling
    reproducible regardless of its batch. `logprobs=True` returns the log-probability of
    each sampled token (from the raw logits), with the `top_logprobs` most likely
    alternatives. `prompt_logprobs=k` (not None) returns each prompt token's logprob and
    its top k, computed in the prompt's own forward pass. `stop` strings are applied to
    the detokenized text by the frontend.

    Logits processing, in this order, before temperature and the filters:
    `repetition_penalty` (transformers' semantics: over prompt and output tokens, a
    positive logit is divided by it, a negative one multiplied), `frequency_penalty` and
    `presence_penalty` (OpenAI's: over output tokens, minus count * frequency minus
    presence if seen), `logit_bias` (token id -> added value), `min_tokens` (EOS and
    `stop_token_ids` barred until that many tokens exist), and `grammar` (an llguidance
    grammar: tokens it does not allow are barred).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    stop: list[str] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    min_tokens: int = 0
    grammar: str | None = None

    def __post_init__(self) -> None:
        for name, rule in FIELD_RULES.items():
            rule.check(name, getattr(self, name))
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias"
            )
        for tok, bias in self.logit_bias.items():
            TOKEN_ID_RULE.check("logit_bias", tok)
            LOGIT_BIAS_RULE.check("logit_bias", bias)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                "min_tokens",
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")

    @property
    def processes_logits(self) -> bool:
        """True when any logits processor applies (the sampler's slow path)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.grammar is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def torch_seed(self) -> int | None:
        """`seed` as torch's unsigned 64-bit generator seed (negative seeds wrap)."""
        return None if self.seed is None else self.seed % 2**64

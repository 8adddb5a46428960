"""Value rules of the sampling fields, checked where a request enters (node or router).

Every field a client can set has one rule in `FIELD_RULES`: numbers must be finite and in
range, integers must fit the wire types (msgpack and torch take at most 64 bits; counts
are capped at int32). A value outside its rule raises `InvalidRequestError` naming the
field. The engine's `SamplingParams` applies these rules at construction; the router
applies the same ones (`check_sampling_values`), so a bad value gets the same 400 body
without reaching a node. To add a sampling field: add it to `SamplingParams` and give it
a rule here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pdserve.common.errors import InvalidRequestError

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
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
    "resumed_tokens": IntRule(0, INT32_MAX),
}
MAX_LOGIT_BIAS = 1024  # entries
MAX_CACHE_SALT = 256
LOGIT_BIAS_RULE = FloatRule(-100.0, 100.0)
TOKEN_ID_RULE = IntRule(0, INT32_MAX)


def check_sampling_values(values: Mapping[str, object]) -> None:
    """Apply every rule to these sampling fields (absent ones are skipped)."""
    for name, rule in FIELD_RULES.items():
        if name in values:
            rule.check(name, values[name])
    logit_bias = values.get("logit_bias", {})
    min_tokens = values.get("min_tokens", 0)
    max_tokens = values.get("max_tokens", 1)
    stop = values.get("stop") or []
    if not isinstance(logit_bias, dict) or len(logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias"
        )
    for tok, bias in logit_bias.items():
        TOKEN_ID_RULE.check("logit_bias", tok)
        LOGIT_BIAS_RULE.check("logit_bias", bias)
    if min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})",
            "min_tokens",
        )
    salt = values.get("cache_salt", "")
    if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT:
        raise InvalidRequestError(
            f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters", "cache_salt"
        )
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(not isinstance(s, str) or not s for s in stop):
        raise InvalidRequestError("stop strings must be non-empty", "stop")


_ASCII_INT = re.compile(r"-?[0-9]{1,19}")


def ascii_int(text: str) -> int | None:
    """`text` as an integer if it is one written in ASCII decimal digits (an optional
    minus, 1-19 digits), else None. `str.isdigit()` is not that test: it accepts
    superscripts such as "²", which `int()` then refuses."""
    return int(text) if _ASCII_INT.fullmatch(text) else None


def check_token_ids(ids: Iterable[int], vocab_size: int | None, field: str) -> None:
    """Raise `InvalidRequestError` naming `field` if any id lies outside [0, vocab_size).

    The one out-of-vocabulary check for prompts, stop_token_ids, logit_bias and
    /detokenize, at the engine, the node and the router alike. Skipped when the
    vocabulary size is unknown (None or 0)."""
    if not vocab_size:
        return
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})", field
        )

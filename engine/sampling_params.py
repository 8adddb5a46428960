"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import msgspec

from engine.errors import InvalidRequestError


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick each next token, and when to stop.

    `temperature == 0` is greedy. `top_k=None`, `top_p=1.0` and `min_p=0.0` disable their
    filters. `seed` makes one request's sampling reproducible regardless of its batch.
    `logprobs=True` returns the log-probability of each sampled token (from the raw logits).
    `stop` strings are applied to the detokenized text by the frontend.
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

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequestError(f"top_k must be >= 1 or unset, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

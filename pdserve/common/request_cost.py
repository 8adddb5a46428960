"""Admission by cost: what one request may ask of a node, checked before the work.

One request can ask for far more than its body's size suggests: `/v1/completions` with 64
prompts, `n: 16`, `echo: true` and `logprobs: 20` is 1,024 engine sequences, each keeping
its prompt length x 21 logprob entries, which the node formats and the router buffers
whole. Three limits bound it, each a setting declared once (pdserve/config/limits.py) and
applied by the router and the node alike:

* `max_sequences_per_request`: prompts x `n`;
* `max_sequence_tokens_per_request`: the prompt tokens of every sequence (prompt tokens
  x `n`: each sequence holds its own copy of the prompt's KV until its blocks are shared);
* `max_logprob_entries_per_request`: with `echo`, prompt length x (alternatives + 1) per
  sequence, plus, when `max_tokens` is given, max_tokens x (alternatives + 1) per sequence.

`meter_for` also caps the size and depth of the request's schemas
(`pdserve.common.schema_bounds`), so a request starts no work for one it cannot compile.

`CostMeter` is charged prompt by prompt, so the caller tokenizes a text prompt only while
the request still fits: a request over a limit stops at the first prompt past it. A
request over a limit gets `InvalidRequestError` (HTTP 400) naming the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pdserve.common.errors import InvalidRequestError
from pdserve.common.schema_bounds import check_request_schemas


@dataclass(frozen=True)
class CostLimits:
    max_sequences_per_request: int
    max_sequence_tokens_per_request: int
    max_logprob_entries_per_request: int

    @classmethod
    def of(cls, config) -> CostLimits:
        """The limits a settings or config object holds under the same field names."""
        return cls(*(getattr(config, f.name) for f in fields(cls)))


class CostMeter:
    def __init__(
        self,
        limits: CostLimits,
        *,
        num_prompts: int,
        n: int,
        alternatives: int | None,
        echo: bool,
        max_tokens: int | None,
    ):
        """`alternatives`: top logprobs asked per position (None: no logprobs)."""
        self.limits, self.n = limits, max(n, 1)
        seqs = num_prompts * self.n
        if seqs > limits.max_sequences_per_request:
            raise InvalidRequestError(
                f"this request asks for {seqs} sequences ({num_prompts} prompt(s) x n={n}); "
                f"the limit is max_sequences_per_request={limits.max_sequences_per_request}",
                "n",
            )
        per_position = 0 if alternatives is None else alternatives + 1
        self.echo_entries = per_position if echo else 0
        self.tokens = 0
        self.entries = seqs * per_position * (max_tokens or 0)
        self._check_entries()

    def add_prompt(self, num_tokens: int) -> None:
        """Charge one prompt of `num_tokens` tokens (for all `n` of its sequences)."""
        self.tokens += num_tokens * self.n
        limit = self.limits.max_sequence_tokens_per_request
        if self.tokens > limit:
            raise InvalidRequestError(
                f"this request's sequences hold more than {limit} prompt tokens in all "
                f"(prompt tokens x n); the limit is max_sequence_tokens_per_request={limit}",
                "prompt",
            )
        self.entries += num_tokens * self.n * self.echo_entries
        self._check_entries()

    def _check_entries(self) -> None:
        limit = self.limits.max_logprob_entries_per_request
        if self.entries > limit:
            raise InvalidRequestError(
                f"this request asks for more than {limit} logprob entries (sequences x "
                f"(echoed prompt tokens + max_tokens) x (logprobs + 1)); the limit is "
                f"max_logprob_entries_per_request={limit}",
                "logprobs",
            )


def meter_for(req, limits: CostLimits, num_prompts: int = 1) -> CostMeter:
    """The meter of an OpenAI completion or chat request (`api.protocol`), once its
    schemas are within their caps."""
    check_request_schemas(req)
    logprobs = req.logprobs
    if isinstance(logprobs, bool):  # chat: logprobs=true with top_logprobs alternatives
        alternatives = (req.top_logprobs or 0) if logprobs else None
    else:
        alternatives = logprobs
    max_tokens = getattr(req, "requested_max_tokens", req.max_tokens)
    return CostMeter(
        limits,
        num_prompts=num_prompts,
        n=req.n,
        alternatives=alternatives,
        echo=getattr(req, "echo", False),
        max_tokens=max_tokens,
    )

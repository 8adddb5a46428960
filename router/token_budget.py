"""Per-client prompt-token limits: a cap per request and a token bucket per minute.

`TokenBudget.admit(client, n)` is called once a request's prompt is tokenized, before any
node is chosen. It raises `TokenLimitExceeded` (the router answers HTTP 429 with an
OpenAI-style body) when

* `n` exceeds `max_prompt_tokens_per_request` (code `request_too_large`; retrying the
  same request cannot help, so no `Retry-After`), or
* the client's bucket holds fewer than `n` tokens (code `rate_limit_exceeded`, with
  `Retry-After`: the whole seconds until the bucket has refilled enough).

Each client (its authenticated API key, else its address: `client_key`) has a bucket of capacity
`prompt_tokens_per_minute` that refills at that rate spread over the minute, so a burst
of one minute's worth is allowed after an idle minute, and the long-run rate never
exceeds the limit. Tokens are charged when a request is admitted, whatever its outcome.
A request larger than the whole bucket is refused as `request_too_large` (it could never
pass). The table is an LRU of `MAX_TRACKED` buckets: the least recently used one is
dropped in O(1) when a new client comes.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_TRACKED = 10_000  # buckets kept (least recently used dropped first)
CLIENT_SCOPE_KEY = "pdserve.client"


def client_key(scope) -> bytes:
    """Who a request counts against for limits: the identity the auth layer proved
    (router/app.py `AuthAndCount` stores it in the scope: the API key), else the client's
    address. Never a header the client picks freely: a rotating `Bearer <random>` is the
    same client."""
    proven = scope.get(CLIENT_SCOPE_KEY)
    if proven is not None:
        return proven
    return b"addr:" + (scope.get("client") or ("?",))[0].encode()


class TokenLimitExceeded(Exception):
    def __init__(self, message: str, code: str, retry_after_s: int | None):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass
class _Bucket:
    level: float
    at: float


class TokenBudget:
    def __init__(
        self,
        per_minute: int = 0,
        per_request: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`per_minute`, `per_request`: 0 means no limit."""
        self.per_minute = per_minute
        self.per_request = per_request
        self.clock = clock
        self._buckets: OrderedDict[bytes, _Bucket] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return bool(self.per_minute or self.per_request)

    def admit(self, client: bytes, n: int) -> None:
        """Charge `n` prompt tokens to `client`, or raise `TokenLimitExceeded`."""
        if self.per_request and n > self.per_request:
            raise TokenLimitExceeded(
                f"the prompt has {n} tokens; this key may send at most "
                f"{self.per_request} prompt tokens per request",
                "request_too_large",
                None,
            )
        if not self.per_minute:
            return
        if n > self.per_minute:
            raise TokenLimitExceeded(
                f"the prompt has {n} tokens, more than this key's whole budget of "
                f"{self.per_minute} prompt tokens per minute",
                "request_too_large",
                None,
            )
        now = self.clock()
        rate = self.per_minute / 60.0
        b = self._buckets.get(client)
        if b is None:
            if len(self._buckets) >= MAX_TRACKED:
                self._buckets.popitem(last=False)
            b = self._buckets[client] = _Bucket(float(self.per_minute), now)
        else:
            self._buckets.move_to_end(client)
        b.level = min(float(self.per_minute), b.level + (now - b.at) * rate)
        b.at = now
        if b.level < n:
            wait = max(1, math.ceil((n - b.level) / rate))
            raise TokenLimitExceeded(
                f"prompt token budget exceeded: {self.per_minute} tokens per minute for "
                f"this key, {int(b.level)} left, this prompt has {n}; retry in {wait} s",
                "rate_limit_exceeded",
                wait,
            )
        b.level -= n

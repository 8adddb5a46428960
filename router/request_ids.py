"""Request ids: the client's `X-Request-Id` if it sent a sane one, else the router's own."""

from __future__ import annotations

import itertools
import secrets

from pdserve.api.http import trace_id


class RequestIds:
    """Request ids: the client's `X-Request-Id` if it sent a sane one (the attempt suffix
    dropped), else a new one: this process's random prefix and a counter (unique across
    router replicas without a random draw per request)."""

    def __init__(self) -> None:
        self._prefix = f"{secrets.token_hex(8)}-"
        self._counter = itertools.count(1)

    def __call__(self, scope) -> str:
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                given = trace_id({"x-request-id": value.decode("latin-1")})
                if given:
                    return given
                break
        return f"{self._prefix}{next(self._counter):x}"

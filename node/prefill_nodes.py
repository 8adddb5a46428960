"""Which prefill nodes a decode node may connect to: a client never chooses an address.

`PrefillNodes` answers, per request, the prefill node's control address: the one named in
`kv_transfer_params.prefill_node` if it is allowed, else the next allowed one in turn.
The allowed set comes from `source`, a callable consulted on every request, so it may
change while the node runs. By default it is the node's configured `--prefill-node`
list; a cluster registry supplies its own callable (e.g. the live prefill nodes it
knows), and nothing else changes. A name outside the set is a 400 naming the field.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection

from pdserve.common.errors import InvalidRequestError

PARAM = "kv_transfer_params.prefill_node"


class PrefillNodes:
    def __init__(self, source: Callable[[], Collection[str]], role: str = "decode"):
        self.source = source
        self.role = role
        self._turn = itertools.count()

    @classmethod
    def configured(cls, nodes: Collection[str], role: str) -> PrefillNodes:
        fixed = tuple(nodes)
        return cls(lambda: fixed, role)

    def choose(self, asked: str | None) -> str | None:
        """The prefill node for one request (None: prefill here, e.g. a colocated node)."""
        if asked is not None:
            if self.role != "decode":
                raise InvalidRequestError(
                    f"this node's role is {self.role}: it takes no prefill_node", PARAM
                )
            allowed = self.source()
            if asked not in allowed:
                raise InvalidRequestError(
                    f"prefill_node {asked[:200]!r} is not one of this node's prefill nodes", PARAM
                )
            return asked
        if self.role != "decode":
            return None
        allowed = sorted(self.source())
        if not allowed:
            return None
        return allowed[next(self._turn) % len(allowed)]

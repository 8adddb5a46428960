"""The cluster secret: who may talk to a node.

One secret per cluster, read from a file (`--cluster-secret-file`, or the path in
`PDSERVE_CLUSTER_SECRET_FILE`) or the environment (`PDSERVE_CLUSTER_SECRET`), never from
a command line (other users of the host can read those). With it:

* the KV control channel between nodes seals every frame (kv_transfer/frame_auth.py);
* a node's HTTP API answers only requests carrying `X-Pdserve-Node-Key`, a key derived
  from the secret (the secret itself never travels), which the router sends; only `/health`
  stays open for probes (`/metrics` and `/debug/` show the cluster: a scraper sends the
  key too). Anything else gets a 401.

Without a secret nodes behave as before, which is safe only while every socket is on
loopback (the default).
"""

from __future__ import annotations

import hmac

from starlette.types import Receive, Scope, Send

from pdserve.api.http import error_response
from pdserve.common.cluster_secret import (  # noqa: F401 (re-exported)
    MIN_SECRET_BYTES,
    NODE_KEY_HEADER,
    SECRET_ENV,
    SECRET_FILE_ENV,
    load_cluster_secret,
    node_key,
)

OPEN_PATHS = ("/health",)


class NodeKeyMiddleware:
    """401 for HTTP requests without the node key (constant-time compare)."""

    def __init__(self, app, secret: bytes | None):
        self.app = app
        self.expected = node_key(secret).encode() if secret else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(NODE_KEY_HEADER.encode(), b"")
        if not hmac.compare_digest(given, self.expected):
            resp = error_response(
                401, "this node answers only its cluster's router", code="invalid_node_key"
            )
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)

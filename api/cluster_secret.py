"""The cluster secret: who may talk to a node.

One secret per cluster, read from a file (`--cluster-secret-file`, or the path in
`PDSERVE_CLUSTER_SECRET_FILE`) or the environment (`PDSERVE_CLUSTER_SECRET`), never from
a command line (other users of the host can read those). With it:

* the KV control channel between nodes seals every frame (kv_transfer/frame_auth.py);
* a node's HTTP API answers only requests carrying `X-Pdserve-Node-Key`, a key derived
  from the secret (the secret itself never travels), which the router sends; `/health`
  and `/metrics` stay open for probes and scrapers. Anything else gets a 401.

Without a secret nodes behave as before, which is safe only while every socket is on
loopback (the default).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from starlette.types import Receive, Scope, Send

from pdserve.api.http import error_response

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
NODE_KEY_HEADER = "x-pdserve-node-key"
OPEN_PATHS = ("/health", "/metrics")
MIN_SECRET_BYTES = 16


def load_cluster_secret(path: str | None = None) -> bytes | None:
    """The secret from `path`, else the environment; None when none is configured.
    Raises ValueError naming the source when it is unreadable or shorter than 16 bytes."""
    path = path or os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            with open(path, "rb") as f:
                secret, source = f.read().strip(), f"cluster secret file {path}"
        except OSError as e:
            raise ValueError(f"cluster secret file {path}: {e.strerror}") from None
    elif os.environ.get(SECRET_ENV):
        secret, source = os.environ[SECRET_ENV].encode(), SECRET_ENV
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{source}: the secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


def node_key(secret: bytes) -> str:
    """The HTTP key nodes accept: derived from the secret, so the secret stays home."""
    return hmac.new(secret, b"pdserve node http", hashlib.sha256).hexdigest()


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

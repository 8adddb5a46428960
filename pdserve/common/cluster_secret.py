"""The cluster secret's loading and what is derived from it (stdlib only: every layer,
the launcher and `pdserve status` included, reads it the same way).

One secret per cluster, read from a file (`--cluster-secret-file`, or the path in
`PDSERVE_CLUSTER_SECRET_FILE`) or the environment (`PDSERVE_CLUSTER_SECRET`), never from
a command line. Keys for each use are derived from it (HMAC-SHA256 with a label), so the
secret itself never travels: the nodes' HTTP key (`node_key`), the registry records'
signing key (cluster/registry.py), the embedded Redis password (common/redis_auth.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os

logger = logging.getLogger(__name__)

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
NODE_KEY_HEADER = "x-pdserve-node-key"
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


def is_loopback(host: str) -> bool:
    """A bind address only this machine reaches."""
    return host == "localhost" or host == "::1" or host.startswith("127.")


def warn_if_open(what: str, host: str, secret: bytes | None) -> bool:
    """Log a loud warning when `what` listens beyond loopback without a cluster secret
    (`pdserve config check` refuses such a cluster; a hand-started process only warns).
    Returns whether it warned."""
    if secret is not None or is_loopback(host):
        return False
    logger.warning(
        "%s listens on %s, beyond loopback, WITHOUT a cluster secret: anyone who reaches it "
        "can use it (set --cluster-secret-file; docs/operations.md)",
        what,
        host or "0.0.0.0",
    )
    return True

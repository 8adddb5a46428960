"""How every process authenticates to the cluster's Redis, and how a Redis URL is shown.

A Redis password never travels on a command line (other users of the host read those):
URLs on argv, in logs, in `cluster.json` and in status output carry no password, and each
process finds it in `PDSERVE_REDIS_PASSWORD` (set by the launcher, or by the user). The
embedded server's password is derived from the cluster secret (`embedded_password`), so a
cluster with a secret never runs an open Redis. `with_password(url)` is what a process
connects with; `redact(url)` is what it shows. Stdlib only: every layer imports it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from urllib.parse import quote, unquote, urlsplit, urlunsplit

PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"


def embedded_password(secret: bytes) -> str:
    """The embedded redis-server's password: derived from the cluster secret."""
    return hmac.new(secret, b"pdserve redis password", hashlib.sha256).hexdigest()


def url_password(url: str) -> str | None:
    """The password written in `url`, if any."""
    password = urlsplit(url).password
    return unquote(password) if password is not None else None


def redact(url: str | None) -> str | None:
    """`url` without its password (user and everything else kept), for display."""
    if not url:
        return url
    u = urlsplit(url)
    if u.password is None:
        return url
    netloc = u.netloc.rsplit("@", 1)[1]
    if u.username:
        netloc = f"{u.username}@{netloc}"
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def with_password(url: str, password: str | None = None) -> str:
    """`url` with the password to connect with: its own, else `password`, else the one in
    `PDSERVE_REDIS_PASSWORD`; unchanged when there is none (or it is a unix:// path)."""
    u = urlsplit(url)
    password = password or os.environ.get(PASSWORD_ENV)
    if u.password is not None or not password or u.scheme not in ("redis", "rediss"):
        return url
    user = u.username or ""
    netloc = f"{user}:{quote(password, safe='')}@{u.netloc}"
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))

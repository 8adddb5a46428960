"""`pdserve router`: the cluster's front door (OpenAI API over prefill/decode nodes).

Static nodes (`--prefill URL`, `--decode URL`, repeatable) work without Redis; with
`--redis-url` the router also follows the registry and the KV index of `--cluster`.
"""

from __future__ import annotations

import argparse
import logging
import os
import typing

from pdserve.api.cluster_secret import load_cluster_secret
from pdserve.common.cluster_secret import warn_if_open
from pdserve.common.redis_auth import with_password
from pdserve.config.fields import add_flags, from_args
from pdserve.config.node import LOG_LEVELS
from pdserve.config.router import RouterProcessSettings, RouterSettings
from pdserve.router.config import RouterConfig, RouterConfigError

logger = logging.getLogger(__name__)

API_KEY_ENV = "PDSERVE_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """A flag per field of the router's settings (pdserve/config/router.py)."""
    for cls in (RouterSettings, RouterProcessSettings):
        add_flags(p.add_argument_group(cls.__doc__.split("\n")[0].rstrip(".:")), cls)
    p.add_argument("--log-level", default="info", choices=typing.get_args(LOG_LEVELS))


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    r, proc = from_args(RouterSettings, args), from_args(RouterProcessSettings, args)
    try:
        secret = load_cluster_secret(proc.cluster_secret_file)
    except ValueError as e:
        raise RouterConfigError("cluster_secret_file", str(e)) from None
    return RouterConfig(
        **r.model_dump(exclude={"api_key"}),
        api_key=r.api_key or os.environ.get(API_KEY_ENV) or None,
        cluster_secret=secret,
        prefill_urls=tuple(proc.prefill),
        decode_urls=tuple(proc.decode),
        redis_url=with_password(proc.redis_url) if proc.redis_url else None,  # env's password
        **proc.model_dump(
            exclude={"prefill", "decode", "cluster_secret_file", "drain_timeout_s", "redis_url"}
        ),
    )


def run(args: argparse.Namespace) -> None:
    from pdserve.api.drain import serve as serve_draining
    from pdserve.router.app import build_app

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe otherwise
    try:
        config = config_from_args(args)
    except RouterConfigError as e:
        raise SystemExit(f"pdserve router: configuration error: {e}") from None
    warn_if_open("the router", config.host, config.cluster_secret)
    serve_draining(
        build_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        drain_timeout_s=args.drain_timeout_s,
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
    )

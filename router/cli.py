"""`pdserve router`: the cluster's front door (OpenAI API over prefill/decode nodes).

Static nodes (`--prefill URL`, `--decode URL`, repeatable) work without Redis; with
`--redis-url` the router also follows the registry and the KV index of `--cluster`.
"""

from __future__ import annotations

import argparse
import logging
import os

from pdserve.api.cluster_secret import load_cluster_secret
from pdserve.router.config import POLICIES, RouterConfig, RouterConfigError

logger = logging.getLogger(__name__)

API_KEY_ENV = "PDSERVE_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RouterConfig
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--model", default=d.model, help="tokenizer and chat template: built-in name, HF dir, .gguf"
    )
    p.add_argument("--served-model-name", default=None, help="name in the API (default: --model)")
    p.add_argument(
        "--redis-url", default=None, help="cluster registry, e.g. redis://127.0.0.1:6379"
    )
    p.add_argument("--cluster", default=d.cluster, help="Redis key prefix of the cluster")
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="static prefill node (repeatable)",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="static decode or colocated node (repeatable)",
    )
    p.add_argument("--prefill-policy", default=d.prefill_policy, choices=POLICIES)
    p.add_argument("--decode-policy", default=d.decode_policy, choices=POLICIES)
    p.add_argument(
        "--overlap-weight",
        type=float,
        default=d.overlap_weight,
        help="kv_aware: weight of blocks to compute",
    )
    p.add_argument(
        "--kv-temperature",
        type=float,
        default=d.kv_temperature,
        help="kv_aware: sample nodes by softmax(-cost / T), T in KV blocks (0: the cheapest)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1/ (default: ${API_KEY_ENV}, which "
        "keeps the key out of the process list)",
    )
    p.add_argument(
        "--cluster-secret-file",
        default=None,
        help="file with the cluster secret (or env PDSERVE_CLUSTER_SECRET): sent to nodes "
        "as their HTTP key",
    )
    p.add_argument(
        "--max-concurrent-per-key",
        type=int,
        default=d.max_concurrent_per_key,
        help="generation requests in flight per client (API key, else address); "
        "more get a 429 (0: no limit)",
    )
    p.add_argument(
        "--prompt-tokens-per-minute-per-key",
        type=int,
        default=d.prompt_tokens_per_minute_per_key,
        help="prompt tokens per minute per client (token bucket); over it: 429 with "
        "Retry-After (0: no limit)",
    )
    p.add_argument(
        "--max-prompt-tokens-per-request",
        type=int,
        default=d.max_prompt_tokens_per_request,
        help="prompt tokens one request may have; more: 429 request_too_large (0: no limit)",
    )
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS: certificate (PEM)")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: private key (PEM)")
    p.add_argument("--max-retries", type=int, default=d.max_retries)
    p.add_argument("--health-interval-s", type=float, default=d.health_interval_s)
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--breaker-failures", type=int, default=d.breaker_failures)
    p.add_argument("--breaker-cooldown-s", type=float, default=d.breaker_cooldown_s)
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=d.body_timeout_s,
        help="a request body not received in full within this many seconds gets a 408",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=5.0,
        help="on SIGTERM: stop accepting, give in-flight requests this long, then exit",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    try:
        secret = load_cluster_secret(args.cluster_secret_file)
    except ValueError as e:
        raise RouterConfigError("cluster_secret_file", str(e)) from None
    return RouterConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        redis_url=args.redis_url,
        cluster=args.cluster,
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        overlap_weight=args.overlap_weight,
        kv_temperature=args.kv_temperature,
        api_key=args.api_key,
        cluster_secret=secret,
        max_concurrent_per_key=args.max_concurrent_per_key,
        prompt_tokens_per_minute_per_key=args.prompt_tokens_per_minute_per_key,
        max_prompt_tokens_per_request=args.max_prompt_tokens_per_request,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        max_retries=args.max_retries,
        health_interval_s=args.health_interval_s,
        request_timeout_s=args.request_timeout_s,
        breaker_failures=args.breaker_failures,
        breaker_cooldown_s=args.breaker_cooldown_s,
        body_timeout_s=args.body_timeout_s,
    )


def run(args: argparse.Namespace) -> None:
    from pdserve.api.drain import serve as serve_draining
    from pdserve.router.app import build_app

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe otherwise
    try:
        config = config_from_args(args)
    except RouterConfigError as e:
        raise SystemExit(f"pdserve router: configuration error: {e}") from None
    serve_draining(
        build_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        drain_timeout_s=args.drain_timeout_s,
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
    )

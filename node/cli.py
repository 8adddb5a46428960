"""`pdserve serve`: one node.

`pdserve serve --model NAME --port P` runs one node: colocated by default;
`--role prefill --kv-control tcp://HOST:PORT` or `--role decode --prefill-node tcp://HOST:PORT`
for prefill/decode disaggregation.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile

from api.http import DEFAULT_MAX_BODY_BYTES
from engine.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from engine.errors import ConfigError
from engine.messages import EngineAddresses

logger = logging.getLogger(__name__)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    model, cache, sched = ModelConfig(), CacheConfig(), SchedulerConfig()
    p.add_argument("--model", default=model.model, help="built-in name, HF directory or .gguf")
    p.add_argument("--served-model-name", default=None, help="name in the API (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dtype", default=model.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=model.device)
    p.add_argument("--block-size", type=int, default=cache.block_size)
    p.add_argument("--kv-cache-bytes", type=int, default=cache.kv_cache_bytes)
    p.add_argument("--num-blocks", type=int, default=None, help="overrides --kv-cache-bytes")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=sched.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=sched.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None, help="engine torch threads")
    p.add_argument(
        "--engine-address",
        default=None,
        help="base ZMQ address of the engine channels, ipc:///path/name or tcp://host:port "
        "(uses port and port+1); default: IPC sockets in a fresh temporary directory",
    )
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    kv = KVTransferConfig()
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--role", default=kv.role, choices=["colocated", "prefill", "decode"])
    g.add_argument("--node-id", default=None, help="name of this node (default: role-port)")
    g.add_argument(
        "--kv-control",
        default=None,
        help="prefill role: ZMQ address its control channel binds, e.g. tcp://127.0.0.1:7100",
    )
    g.add_argument(
        "--prefill-node",
        action="append",
        default=[],
        help="decode role: control address of a prefill node (repeatable; round-robin)",
    )
    g.add_argument("--kv-connector", default=kv.connector, choices=["nixl"])
    g.add_argument("--kv-transfer-timeout", type=float, default=kv.transfer_timeout_s)
    g.add_argument("--kv-abort-grace", type=float, default=kv.abort_grace_s)
    g.add_argument(
        "--on-prefill-failure",
        default=kv.on_prefill_failure,
        choices=["local", "error"],
        help="decode role: prefill locally, or end the request with an error",
    )
    g.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=SchedulerConfig().local_prefill_max_tokens,
        help="decode role: prefill an uncached suffix this short here instead",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_bytes,
            num_blocks=args.num_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            local_prefill_max_tokens=args.local_prefill_max_tokens,
        ),
        kv_transfer=KVTransferConfig(
            role=args.role,
            connector=args.kv_connector,
            node_id=args.node_id or f"{args.role}-{args.port}",
            control_address=args.kv_control,
            prefill_nodes=tuple(args.prefill_node),
            transfer_timeout_s=args.kv_transfer_timeout,
            abort_grace_s=args.kv_abort_grace,
            on_prefill_failure=args.on_prefill_failure,
        ),
        num_threads=args.num_threads,
    )


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from node.api_server import build_app

    config = engine_config_from_args(args)
    tmpdir = None
    if args.engine_address:
        addresses = EngineAddresses.from_base(args.engine_address)
    else:
        tmpdir = tempfile.mkdtemp(prefix="pdserve-")
        addresses = EngineAddresses.from_base(f"ipc://{tmpdir}/engine")
    try:
        app = build_app(config, addresses, args.served_model_name, args.max_body_bytes)
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            access_log=False,
        )
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pdserve serve`: one node over HTTP (colocated, prefill or decode)."""
    _add_serve_args(p)


def run(args: argparse.Namespace) -> None:
    try:
        serve(args)
    except ConfigError as e:
        raise SystemExit(f"pdserve serve: configuration error: {e}") from None

"""`pdserve serve`: one node.

`pdserve serve --model NAME --port P` runs one node: colocated by default;
`--role prefill --kv-control tcp://HOST:PORT` or `--role decode --prefill-node tcp://HOST:PORT`
for prefill/decode disaggregation. `--config CLUSTER.yaml --node NAME` takes every setting
of node NAME (e.g. `prefill-0`) from a cluster config file (cluster/schema.py); flags given
on the command line win over the file.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile

from pdserve.api.body_deadline import DEFAULT_BODY_TIMEOUT_S
from pdserve.api.cluster_secret import load_cluster_secret
from pdserve.api.http import DEFAULT_MAX_BODY_BYTES
from pdserve.common.errors import ConfigError
from pdserve.engine.config import (
    KV_LAYOUTS,
    CacheConfig,
    EngineConfig,
    KVBackendConfig,
    KVStoreConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from pdserve.engine.messages import EngineAddresses
from pdserve.node.cluster_agent import ClusterOptions

logger = logging.getLogger(__name__)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    model, cache, sched = ModelConfig(), CacheConfig(), SchedulerConfig()
    p.add_argument("--model", default=model.model, help="built-in name, HF directory or .gguf")
    p.add_argument("--served-model-name", default=None, help="name in the API (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dtype", default=model.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=model.device)
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--no-enforce-eager: compile the model step piecewise (CPU); default: eager, "
        "measured as fast or faster (docs/benchmarks.md)",
    )
    p.add_argument(
        "--batched-decode",
        action=argparse.BooleanOptionalAction,
        default=model.cpu_batched_decode,
        help="CPU fp32/bf16: decode steps of 9-256 rows as one native call on packed weights "
        "(--no-batched-decode: oneDNN's GEMMs; saves a copy of the weights)",
    )
    p.add_argument("--block-size", type=int, default=cache.block_size)
    p.add_argument(
        "--kv-layout",
        default=cache.layout,
        choices=list(KV_LAYOUTS),
        help="KV cache storage order (prefill and decode nodes must match for NIXL; docs/configuration.md)",
    )
    p.add_argument("--kv-cache-bytes", type=int, default=cache.kv_cache_bytes)
    p.add_argument("--num-blocks", type=int, default=None, help="overrides --kv-cache-bytes")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--kv-populate",
        action=argparse.BooleanOptionalAction,
        default=cache.populate,
        help="CPU: fault the whole KV cache in at start, so the first requests do not pay "
        "page faults (--no-kv-populate: a faster start, faults on first use)",
    )
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
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="a request body not received in full within this many seconds gets a 408",
    )
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
    g.add_argument(
        "--kv-connector",
        default=kv.connector,
        choices=["nixl", "lmcache"],
        help="how KV moves: nixl (point to point) or lmcache (through the --kv-store-url Redis)",
    )
    g.add_argument("--kv-transfer-timeout", type=float, default=kv.transfer_timeout_s)
    g.add_argument("--kv-abort-grace", type=float, default=kv.abort_grace_s)
    g.add_argument(
        "--kv-net-devices",
        default="auto",
        help="devices the NIXL/UCX data plane listens on (UCX_NET_DEVICES, e.g. lo, eth0); "
        "auto: lo when --host is loopback, else all",
    )
    g.add_argument(
        "--kv-peer-timeout",
        type=float,
        default=kv.peer_timeout_s,
        help="decode role: seconds without an answer before a prefill node counts as dead "
        "(its requests fail over at once)",
    )
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
    g = p.add_argument_group("cluster registry (Redis)")
    g.add_argument(
        "--redis-url",
        default=None,
        help="register in this Redis (TTL heartbeat) and publish KV block events, "
        "e.g. redis://127.0.0.1:6379",
    )
    g.add_argument("--cluster", default="pdserve", help="Redis key prefix of the cluster")
    g.add_argument(
        "--advertise-url", default=None, help="this node's HTTP url (default http://HOST:PORT)"
    )
    g.add_argument("--heartbeat-s", type=float, default=1.0, help="registry heartbeat period")
    g.add_argument(
        "--node-ttl-s", type=float, default=5.0, help="registry record TTL (> heartbeat)"
    )
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=5.0,
        help="on SIGTERM: stop accepting, give in-flight requests this long, then exit",
    )
    g.add_argument(
        "--cluster-secret-file",
        default=None,
        help="file with the cluster secret (or env PDSERVE_CLUSTER_SECRET): authenticated KV "
        "control frames, HTTP only from the router (api/cluster_secret.py)",
    )
    st = KVStoreConfig()
    g = p.add_argument_group("shared KV store (prefix reuse across nodes and restarts)")
    g.add_argument("--kv-store", default=None, choices=["lmcache"], help="off unless set")
    g.add_argument(
        "--kv-store-url",
        default=None,
        help="redis://HOST:PORT shared by the nodes, or `cluster` (the --redis-url)",
    )
    g.add_argument("--kv-store-chunk-size", type=int, default=st.chunk_size)
    g.add_argument("--kv-store-local-bytes", type=int, default=st.local_cpu_bytes)
    g.add_argument("--kv-store-namespace", default=None, help="default: the --model value")
    g.add_argument("--kv-store-load-timeout", type=float, default=st.load_timeout_s)
    g.add_argument("--kv-store-save-timeout", type=float, default=st.save_timeout_s)
    g.add_argument("--kv-store-retry-after", type=float, default=st.retry_after_s)
    g.add_argument(
        "--kv-backend",
        action="append",
        default=[],
        metavar="KIND:ROLES[:URL]",
        help="a KV backend, in order (repeatable; replaces --kv-connector/--kv-store): KIND "
        "nixl or lmcache, ROLES from transfer,load,save, URL redis://... or `cluster`; e.g. "
        "--kv-backend nixl:transfer --kv-backend lmcache:load,save:cluster",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def cluster_options_from_args(args: argparse.Namespace) -> ClusterOptions:
    try:
        return ClusterOptions(
            advertise_url=args.advertise_url or f"http://{args.host}:{args.port}",
            redis_url=args.redis_url,
            cluster=args.cluster,
            heartbeat_s=args.heartbeat_s,
            node_ttl_s=args.node_ttl_s,
        )
    except ValueError as e:
        raise ConfigError("cluster", str(e)) from None


def _net_devices(args: argparse.Namespace) -> str | None:
    """UCX_NET_DEVICES for the data plane: loopback nodes keep it on `lo` (None: all)."""
    devices = getattr(args, "kv_net_devices", "auto")
    if devices != "auto":
        return devices
    loopback = args.host in ("localhost", "::1") or args.host.startswith("127.")
    return "lo" if loopback else None


def _cluster_secret(args: argparse.Namespace) -> bytes | None:
    try:
        return load_cluster_secret(getattr(args, "cluster_secret_file", None))
    except ValueError as e:
        raise ConfigError("cluster_secret_file", str(e)) from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            served_model_name=args.served_model_name,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager,
            cpu_batched_decode=args.batched_decode,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            layout=getattr(args, "kv_layout", CacheConfig.layout),
            kv_cache_bytes=args.kv_cache_bytes,
            num_blocks=args.num_blocks,
            enable_prefix_caching=not args.no_prefix_caching,
            populate=args.kv_populate,
            kv_events=args.redis_url is not None,
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
            peer_timeout_s=args.kv_peer_timeout,
            on_prefill_failure=args.on_prefill_failure,
            cluster_secret=_cluster_secret(args),
            net_devices=_net_devices(args),
        ),
        kv_store=KVStoreConfig(
            backend=args.kv_store,
            remote_url=args.redis_url if args.kv_store_url == "cluster" else args.kv_store_url,
            chunk_size=args.kv_store_chunk_size,
            local_cpu_bytes=args.kv_store_local_bytes,
            namespace=args.kv_store_namespace,
            load_timeout_s=args.kv_store_load_timeout,
            save_timeout_s=args.kv_store_save_timeout,
            retry_after_s=args.kv_store_retry_after,
        ),
        kv_backends=parse_backends(getattr(args, "kv_backend", []), args.redis_url),
        num_threads=args.num_threads,
    )


def parse_backends(specs: list[str], redis_url: str | None) -> tuple[KVBackendConfig, ...]:
    """`KIND:ROLES[:URL]` per backend (URL `cluster`: the node's --redis-url)."""
    out = []
    for i, spec in enumerate(specs):
        parts = spec.split(":", 2)
        if len(parts) < 2:
            raise ConfigError(f"--kv-backend[{i}]", f"expected KIND:ROLES[:URL], got {spec!r}")
        url = parts[2] if len(parts) == 3 else None
        if url == "cluster":
            if redis_url is None:
                raise ConfigError(f"--kv-backend[{i}]", "URL `cluster` needs --redis-url")
            url = redis_url
        roles = tuple(r.strip() for r in parts[1].split(",") if r.strip())
        out.append(KVBackendConfig(parts[0], roles, remote_url=url))
    return tuple(out)


def serve(args: argparse.Namespace) -> None:
    from pdserve.api.drain import serve as serve_draining
    from pdserve.node.api_server import build_app

    if not args.body_timeout_s > 0:
        raise ConfigError("--body-timeout-s", f"must be > 0, got {args.body_timeout_s}")
    if not args.max_body_bytes >= 1:
        raise ConfigError("--max-body-bytes", f"must be >= 1, got {args.max_body_bytes}")
    config = engine_config_from_args(args)
    cluster = cluster_options_from_args(args)
    tmpdir = None
    if args.engine_address:
        addresses = EngineAddresses.from_base(args.engine_address)
    else:
        tmpdir = tempfile.mkdtemp(prefix="pdserve-")
        addresses = EngineAddresses.from_base(f"ipc://{tmpdir}/engine")
    try:
        app = build_app(
            config,
            addresses,
            args.served_model_name,
            args.max_body_bytes,
            cluster=cluster,
            body_timeout_s=args.body_timeout_s,
        )
        serve_draining(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            drain_timeout_s=args.drain_timeout_s,
        )
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


CONFIG_DESTS = ("config", "node", "set", "help", "log_level", "serve_defaults")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pdserve serve`: one node over HTTP (colocated, prefill or decode)."""
    _add_serve_args(p)
    g = p.add_argument_group("settings from a cluster config file")
    g.add_argument("--config", default=None, help="cluster YAML file (see docs/configuration.md)")
    g.add_argument("--node", default=None, help="with --config: the node to run, e.g. decode-0")
    g.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    # Precedence: flags given > the config file > built-in defaults. So that "given" is
    # knowable, flags default to absent and their defaults are applied in run().
    defaults = {}
    for action in p._actions:
        if action.dest not in CONFIG_DESTS:
            defaults[action.dest] = action.default
            action.default = argparse.SUPPRESS
    p.set_defaults(serve_defaults=defaults)


def resolve_settings(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults, then the node's settings from `--config` (if any), then the flags given."""
    values = dict(args.serve_defaults)
    if args.config:
        from pdserve.cluster.config_file import load_config
        from pdserve.cluster.nodes import find_node, node_settings

        if not args.node:
            raise ConfigError("--node", "--config needs --node NAME (e.g. decode-0)")
        cfg = load_config(args.config, args.set)
        try:
            node = find_node(cfg, args.node)
        except KeyError as e:
            raise ConfigError("--node", e.args[0]) from None
        values.update(node_settings(cfg, node))
    elif args.node or args.set:
        raise ConfigError("--node", "--node and --set need --config FILE")
    values.update({k: v for k, v in vars(args).items() if k not in CONFIG_DESTS})
    values["log_level"] = args.log_level
    return argparse.Namespace(**values)


def run(args: argparse.Namespace) -> None:
    from pdserve.cluster.config_file import ConfigFileError

    try:
        serve(resolve_settings(args))
    except (ConfigError, ConfigFileError) as e:
        raise SystemExit(f"pdserve serve: configuration error: {e}") from None

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
import typing
from typing import NamedTuple

from pdserve.api.cluster_secret import load_cluster_secret
from pdserve.common.cluster_secret import warn_if_open
from pdserve.common.errors import ConfigError
from pdserve.common.redis_auth import with_password
from pdserve.config.engine import (
    CacheSettings,
    ComputeSettings,
    KVFormatSettings,
    ModelSettings,
    SchedulerSettings,
)
from pdserve.config.fields import add_flags, from_args
from pdserve.config.kv import StoreSettings, TransferSettings
from pdserve.config.node import (
    LOG_LEVELS,
    NODE_SECTIONS,
    HTTPSettings,
    RegistrySettings,
    ServeSettings,
)
from pdserve.engine.config import (
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


class NodeSettings(NamedTuple):
    """Everything `pdserve serve` runs with, one typed settings object per component."""

    model: ModelSettings
    kv_format: KVFormatSettings
    compute: ComputeSettings
    cache: CacheSettings
    scheduler: SchedulerSettings
    http: HTTPSettings
    transfer: TransferSettings
    store: StoreSettings
    registry: RegistrySettings
    serve: ServeSettings

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NodeSettings:
        return cls(*(from_args(c, args) for c in SERVE_CLASSES))


# NodeSettings' components in field order (tests/test_settings.py checks it).
SERVE_CLASSES = tuple(c for c, _ in NODE_SECTIONS) + (ServeSettings,)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """A flag per settings field (pdserve/config/), grouped by component."""
    for cls in SERVE_CLASSES:
        add_flags(p.add_argument_group(cls.__doc__.split("\n")[0].rstrip(".:")), cls)
    p.add_argument("--log-level", default="info", choices=typing.get_args(LOG_LEVELS))


def cluster_options(s: NodeSettings) -> ClusterOptions:
    http, sv = s.http, s.serve
    try:
        return ClusterOptions(
            advertise_url=sv.advertise_url or f"http://{http.host}:{http.port}",
            redis_url=_redis(sv.redis_url),
            cluster=sv.cluster,
            heartbeat_s=s.registry.heartbeat_s,
            node_ttl_s=s.registry.node_ttl_s,
        )
    except ValueError as e:
        raise ConfigError("cluster", str(e)) from None


def _net_devices(devices: str, host: str) -> str | None:
    """UCX_NET_DEVICES for the data plane: the interface that holds the node's address
    (`lo` for loopback), so UCX listens where the node binds; None (all) only for a
    wildcard bind or an address no local interface holds."""
    if devices != "auto":
        return devices
    if host in ("localhost", "::1") or host.startswith("127."):
        return "lo"
    return _interface_of(host)


def _interface_of(addr: str) -> str | None:
    """The local interface whose IPv4 address is `addr` (SIOCGIFADDR on each one)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(got[20:24]) == addr:
                return name
    return None


def engine_address(base: str) -> str:
    """The engine channels' base address: ipc:// only. Over tcp:// anyone who reaches the
    port could feed the engine requests (the channel has no authentication)."""
    if not base.startswith("ipc://"):
        raise ConfigError(
            "engine_address",
            f"{base!r}: only ipc:///path/name (a tcp:// engine channel would be open to "
            "anyone who reaches its port)",
        )
    return base


def _redis(url: str | None) -> str | None:
    """A Redis URL as this process connects to it: with the password from the environment
    (pdserve/common/redis_auth.py), which never rides on the command line."""
    return with_password(url) if url else None


def _cluster_secret(path: str | None) -> bytes | None:
    try:
        return load_cluster_secret(path)
    except ValueError as e:
        raise ConfigError("cluster_secret_file", str(e)) from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return engine_config(NodeSettings.from_args(args))


def engine_config(s: NodeSettings) -> EngineConfig:
    """The engine's config: the components' fields under their own names, plus what a
    node derives (its id, the Redis URL that `cluster` stands for, the secret's bytes)."""
    sv, t, st = s.serve, s.transfer, s.store
    lmcache_transfer = sv.role != "colocated" and t.kind == "lmcache"
    uses_store = st.backend is not None or lmcache_transfer or bool(sv.kv_backend)
    store_url = _redis(sv.redis_url if st.url == "cluster" else st.url) if uses_store else None
    return EngineConfig(
        model=ModelConfig(
            name=s.model.name,
            served_name=s.model.served_name,
            device=s.compute.device,
            **s.model.model_dump(exclude={"name", "served_name"}),
        ),
        cache=CacheConfig(
            **s.kv_format.model_dump(), **s.cache.model_dump(), kv_events=sv.redis_url is not None
        ),
        scheduler=SchedulerConfig(**s.scheduler.model_dump(exclude={"on_prefill_failure"})),
        kv_transfer=KVTransferConfig(
            role=sv.role,
            connector=t.kind,
            node_id=sv.node_id or f"{sv.role}-{s.http.port}",
            control_address=sv.kv_control,
            prefill_nodes=tuple(sv.prefill_node),
            on_prefill_failure=s.scheduler.on_prefill_failure,
            cluster_secret=_cluster_secret(sv.cluster_secret_file),
            net_devices=_net_devices(t.net_devices, s.http.host),
            **t.model_dump(exclude={"kind", "net_devices"}),
        ),
        kv_store=KVStoreConfig(
            remote_url=store_url,
            namespace=sv.kv_store_namespace,
            **st.model_dump(exclude={"url"}),
        ),
        kv_backends=parse_backends(sv.kv_backend, _redis(sv.redis_url)),
        num_threads=s.compute.num_threads,
        tensor_parallel_size=s.compute.tensor_parallel_size,
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
    from pdserve.api.drain import EXIT_STUCK
    from pdserve.api.drain import serve as serve_draining
    from pdserve.node.api_server import EXIT_ENGINE_DEAD, build_app

    settings = NodeSettings.from_args(args)
    config = engine_config(settings)
    cluster = cluster_options(settings)
    warn_if_open("this node", settings.http.host, config.kv_transfer.cluster_secret)
    tmpdir = None
    if settings.serve.engine_address:
        addresses = EngineAddresses.from_base(engine_address(settings.serve.engine_address))
    else:
        tmpdir = tempfile.mkdtemp(prefix="pdserve-")
        addresses = EngineAddresses.from_base(f"ipc://{tmpdir}/engine")
    try:
        app = build_app(
            config,
            addresses,
            settings.model.served_name,
            settings.http.max_body_bytes,
            cluster=cluster,
            body_timeout_s=settings.http.body_timeout_s,
            limits=settings.http.cost_limits,
            grammar_deadline_s=settings.http.grammar_deadline_s,
            grammar_workers=settings.http.grammar_workers,
        )

        def exit_code() -> int:  # of a stop forced at its deadline, or after `serve`
            return EXIT_ENGINE_DEAD if getattr(app.state, "engine_died", None) else EXIT_STUCK

        serve_draining(
            app,
            host=settings.http.host,
            port=settings.http.port,
            log_level=args.log_level,
            drain_timeout_s=settings.registry.drain_timeout_s,
            exit_code=exit_code,
        )
        if exit_code() == EXIT_ENGINE_DEAD:  # node/api_server.py: restart me
            raise SystemExit(EXIT_ENGINE_DEAD)
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

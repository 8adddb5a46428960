"""`pdserve launch` on one machine: Redis, the nodes and the router as local processes.

The run directory (`launcher.run_dir/<cluster>-<time>/`, with `<cluster>-latest` linking
to it) holds one log per process, `launcher.log`, and `cluster.json`: every service with
its state, pid, url, log and restart count, rewritten on every change and also stored in
Redis under `<cluster>:launcher`, which is where `pdserve status` reads it.

Each node runs `pdserve serve --config FILE --node NAME`: it reads the same file through
the same loader, so what `pdserve config check` accepted is exactly what runs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from pdserve.cluster.checks import insecure_warning, ports_in_use
from pdserve.cluster.config_file import ConfigFileError, Issue
from pdserve.cluster.embedded_redis import EmbeddedRedis, _free_port
from pdserve.cluster.nodes import NodeSpec, cluster_nodes, router_argv, router_env, serve_argv
from pdserve.cluster.process import ManagedProcess
from pdserve.cluster.schema import ClusterConfig
from pdserve.cluster.supervisor import LaunchError, Service, Supervisor
from pdserve.common.cluster_secret import load_cluster_secret
from pdserve.common.redis_auth import (
    PASSWORD_ENV,
    embedded_password,
    redact,
    url_password,
    with_password,
)
from pdserve.common.redis_keys import ClusterKeys

logger = logging.getLogger(__name__)


def http_healthy(url: str) -> Callable[[], bool]:
    """A liveness probe of a process this launcher started. An https:// URL is probed without
    certificate checks: the answer only tells that the process is up, and trusts no data."""

    def probe() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2.0, verify=False).status_code == 200
        except httpx.HTTPError:
            return False

    return probe


def make_run_dir(cfg: ClusterConfig) -> Path:
    root = Path(cfg.launcher.run_dir)
    run_dir = root / f"{cfg.cluster}-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = root / f"{cfg.cluster}-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    run_dir.mkdir(parents=True)
    latest = root / f"{cfg.cluster}-latest"
    if latest.is_symlink() or not latest.exists():
        latest.unlink(missing_ok=True)
        latest.symlink_to(run_dir.name)
    return run_dir


class ClusterState:
    """cluster.json in the run directory, mirrored to Redis for `pdserve status`."""

    def __init__(self, cfg: ClusterConfig, run_dir: Path, config_file: str):
        self.cfg = cfg
        self.run_dir = run_dir
        self.config_file = config_file
        self.redis_url: str | None = None  # never with a password (shown, written, on argv)
        self.redis_password: str | None = None  # reaches processes by environment only
        self.router_url: str | None = None
        self.services: list[Service] = []
        self.started = time.time()
        self.cleanups: list[Callable[[], None]] = []  # run after every process stopped

    def as_dict(self) -> dict:
        return {
            "cluster": self.cfg.cluster,
            "config": self.config_file,
            "run_dir": str(self.run_dir.resolve()),
            "launcher": self.cfg.launcher.kind,
            "launcher_pid": os.getpid(),
            "started": self.started,
            "redis_url": self.redis_url,
            "redis_embedded": self.cfg.redis.embedded,
            "router_url": self.router_url,
            "services": [
                {
                    "name": s.name,
                    "kind": s.kind,
                    "state": s.state,
                    "pid": s.handle.pid,
                    "url": s.url,
                    "log": s.log,
                    "restarts": s.total_restarts,
                    **({"where": s.where} if s.where else {}),
                }
                for s in self.services
            ],
        }

    def write(self) -> None:
        data = self.as_dict()
        tmp = self.run_dir / "cluster.json.tmp"
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.run_dir / "cluster.json")
        if self.redis_url:
            try:
                import redis

                url = with_password(self.redis_url, self.redis_password)
                with redis.Redis.from_url(url, socket_timeout=1.0) as r:
                    r.set(ClusterKeys(self.cfg.cluster).launcher, json.dumps(data))
            except Exception as e:  # Redis down or restarting: the file still has it
                logger.debug("could not store the launcher state in Redis: %s", e)


def process_env(state: ClusterState, base: dict[str, str] | None = None) -> dict[str, str]:
    """A started process's environment (`base`, default this one's): with the Redis password
    when the cluster's Redis has one (pdserve/common/redis_auth.py)."""
    env = dict(os.environ if base is None else base)
    env.pop(PASSWORD_ENV, None)
    if state.redis_password:
        env[PASSWORD_ENV] = state.redis_password
    return env


def status_screen(state: ClusterState, elapsed_s: float) -> str:
    lines = [
        f"pdserve cluster '{state.cfg.cluster}' is up in {elapsed_s:.1f} s "
        f"(run dir {state.run_dir})",
        f"  {'service':<12} {'state':<9} {'pid':>8}  url",
    ]
    for s in state.services:
        lines.append(f"  {s.name:<12} {s.state:<9} {s.handle.pid or '-':>8}  {s.url}")
    if state.router_url:
        lines.append(f"OpenAI API: {state.router_url}/v1")
    lines.append(f"logs: {state.run_dir}/*.log   status: pdserve status   Ctrl-C: drain and stop")
    return "\n".join(lines)


def redis_stage(
    cfg: ClusterConfig, run_dir: Path, state: ClusterState, overrides: list[str]
) -> tuple[list[list[Service]], list[str]]:
    """The embedded Redis stage (if any), and the overrides that point nodes at Redis."""
    node_overrides = list(overrides)
    if not cfg.redis.embedded:
        # A password in the URL leaves it here: processes get it by environment.
        state.redis_url = redact(cfg.redis.url)
        state.redis_password = url_password(cfg.redis.url) or os.environ.get(PASSWORD_ENV)
        if state.redis_password:
            node_overrides.append(f"redis.url={state.redis_url}")
        return [], node_overrides
    try:
        secret = load_cluster_secret(cfg.secret_file) if cfg.secret_file else None
    except ValueError as e:
        raise LaunchError(f"secret_file: {e}") from None
    state.redis_password = embedded_password(secret) if secret else None
    port = cfg.redis.port or _free_port(cfg.redis.host)
    conf = run_dir / "redis.conf"
    redis = EmbeddedRedis(cfg.redis.host, port, password=state.redis_password, conf_file=conf)
    proc = ManagedProcess(redis.command(), run_dir / "redis.log", env=process_env(state))
    state.cleanups.append(lambda: conf.unlink(missing_ok=True))
    state.redis_url = redis.url
    node_overrides.append(f"redis.url={redis.url}")
    return [[Service("redis", "redis", proc, redis.ping, redis.url, str(proc.log_path))]], (
        node_overrides
    )


def router_stage(
    cfg: ClusterConfig, nodes: list[NodeSpec], run_dir: Path, state: ClusterState
) -> list[list[Service]]:
    if not cfg.router.enabled:
        return []
    r = cfg.router
    scheme = "https" if r.ssl_certfile else "http"
    url = f"{scheme}://{'127.0.0.1' if r.host in ('0.0.0.0', '') else r.host}:{r.port}"
    argv = router_argv(cfg, state.redis_url, nodes, cfg.launcher.log_level)
    state.router_url = url
    env = process_env(state, router_env(cfg))
    return [[_service("router", "router", argv, url, run_dir, env=env)]]


def local_services(
    cfg: ClusterConfig, config_file: str, overrides: list[str], run_dir: Path, state: ClusterState
) -> list[list[Service]]:
    """Stages of local processes: [redis], [nodes], [router]."""
    stages, node_overrides = redis_stage(cfg, run_dir, state, overrides)
    nodes = cluster_nodes(cfg)
    level = cfg.launcher.log_level
    node_services = []
    for node in nodes:
        argv = serve_argv(config_file, node, node_overrides, log_level=level)
        env = process_env(state)
        node_services.append(_service(node.name, node.role, argv, node.url, run_dir, env))
    stages.append(node_services)
    return stages + router_stage(cfg, nodes, run_dir, state)


def _service(
    name: str, kind: str, argv: list[str], url: str, run_dir: Path, env: dict | None = None
) -> Service:
    proc = ManagedProcess(argv, run_dir / f"{name}.log", env=env)
    return Service(name, kind, proc, http_healthy(url), url, str(proc.log_path))


def _cleanup(state: ClusterState) -> None:
    for fn in state.cleanups:
        try:
            fn()
        except Exception as e:
            logger.warning("cleanup failed: %s", e)


def run_cluster(
    cfg: ClusterConfig,
    config_file: str,
    overrides: list[str],
    build: Callable[..., list[list[Service]]] = local_services,
) -> int:
    """Launch, supervise until SIGINT/SIGTERM, drain and stop. Returns the exit code."""
    config_file = str(Path(config_file).resolve())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per health probe
    if cfg.launcher.kind == "local":
        busy = ports_in_use(cfg)
        if busy:
            from pdserve.cluster.config_file import dotted

            issues = [Issue(dotted(path), config_file, msg) for path, msg in busy]
            raise ConfigFileError(issues)
    run_dir = make_run_dir(cfg)
    state = ClusterState(cfg, run_dir, config_file)
    launcher_log = open(run_dir / "launcher.log", "a", buffering=1)  # noqa: SIM115

    def say(msg: str) -> None:
        print(msg, flush=True)
        launcher_log.write(f"{time.strftime('%H:%M:%S')} {msg}\n")

    try:
        stages = build(cfg, config_file, overrides, run_dir, state)
    except LaunchError as e:
        say(f"[launch] launch failed: {e}")
        _cleanup(state)
        launcher_log.close()
        return 1
    state.services = [s for stage in stages for s in stage]
    sup = Supervisor(
        stages,
        cfg.launcher.restart,
        cfg.launcher.startup_timeout_s,
        cfg.launcher.drain_timeout_s,
        say=say,
        on_change=state.write,
    )

    def request_stop(signum: int, frame: object) -> None:
        if not sup.stop_requested:
            say(f"[launch] {signal.Signals(signum).name}: draining and stopping the cluster")
        sup.stop_requested = True

    old = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    code = 0
    try:
        say(f"[launch] cluster '{cfg.cluster}': {len(state.services)} processes, run dir {run_dir}")
        if warning := insecure_warning(cfg):
            say(f"[launch] {warning}")
        sup.start_all()
        say(status_screen(state, time.monotonic() - t0))
        sup.supervise()
    except LaunchError as e:
        say(f"[launch] launch failed: {e}")
        code = 0 if sup.stop_requested else 1
    finally:
        sup.stop_all()
        state.write()
        _cleanup(state)
        say("[launch] stopped")
        launcher_log.close()
        for s, handler in old.items():
            signal.signal(s, handler)
    return code

"""`launcher: ray`: the same cluster config, with each node placed on a Ray node.

Every node gets a Ray actor (`NodeActor`) reserving the group's `ray.num_cpus`,
`ray.num_gpus` and custom `ray.resources`, so Ray puts it on a machine that has them.
The actor runs `pdserve serve --config ... --node NAME` as an ordinary child process of
its own (a `ManagedProcess`: own process group, log file, dies with the actor) and
answers `poll`/`signal`/`stop`/`tail`, so the same `Supervisor` watches, restarts and
drains it as a local process. The config text travels to the actor, which writes it on
its own host; a group with `host: auto` binds the IP of the Ray node it landed on (the
launcher passes every node's resolved host with `--set GROUP.host=[...]`, so decode nodes
and the router learn the prefill nodes' addresses from the same loader).

Node logs come back to the launcher: the actor writes its node's output on its own host
(its own temporary directory there), and the launcher copies what is new into the run
directory (`run_dir/<node>.log`) on every few supervisor ticks (`LOG_PULL_S`), and all of
it when the node stops; while a host does not answer, its log just catches up later.

The router (and an embedded Redis) run on the launcher's machine, as with the local
launcher. Across machines every node must reach them there: `router.host` is the
launcher machine's address, and Redis is a `redis://:PASSWORD@HOST:PORT` server bound to
it (the embedded one serves loopback only); each node's NIXL/UCX data plane listens on the
interface holding its own `host` (node/cli.py `_net_devices`). configs/multihost-ray.yaml
and docs/operations.md "Multi-host" show the whole layout.
Ray is an optional dependency: `pip install 'pdserve[ray]'`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from pdserve.cluster.launcher import ClusterState, http_healthy, redis_stage, router_stage
from pdserve.cluster.nodes import cluster_nodes, serve_argv
from pdserve.cluster.process import ManagedProcess, log_tail
from pdserve.cluster.schema import ClusterConfig
from pdserve.cluster.supervisor import LaunchError, Service
from pdserve.common.redis_auth import PASSWORD_ENV

PLACEMENT_TIMEOUT_S = 120.0
POLL_TIMEOUT_S = 3.0  # a supervisor tick waits at most this for a node's host
LOG_PULL_S = 2.0  # how often the launcher copies new node log bytes back
LOG_CHUNK = 1 << 20  # bytes per pull
# Environment a node process needs from the launcher (the actor's own may differ).
PASS_ENV = (
    "PYTHONPATH",
    "PDSERVE_CACHE_DIR",
    "PDSERVE_CPU_ATTENTION",
    "PDSERVE_KERNEL_CACHE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)


class NodeActor:
    """Owns one node process on whichever Ray node it was placed on."""

    def __init__(self, config_text: str, env: dict[str, str]):
        import ray

        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-ray-"))
        self.config_path = self.dir / "cluster.yaml"
        self.config_path.write_text(config_text)
        self.env = {**os.environ, **env, "TOKENIZERS_PARALLELISM": "false"}
        self.node_id = ray.get_runtime_context().get_node_id()
        self.proc: ManagedProcess | None = None

    def where(self) -> dict:
        import ray

        node = next((n for n in ray.nodes() if n["NodeID"] == self.node_id), {})
        return {
            "ip": node.get("NodeManagerAddress") or ray.util.get_node_ip_address(),
            "ray_node_id": self.node_id,
            "ray_resources": node.get("Resources", {}),
        }

    def start(self, args: list[str]) -> int:
        """Run `python -m pdserve serve --config <local copy> ARGS`, its output in a log
        file on this host (`read_log`); returns its pid."""
        argv = [sys.executable, "-m", "pdserve", "serve", "--config", str(self.config_path)]
        self.proc = ManagedProcess(argv + args, self.dir / "node.log", env=self.env)
        self.proc.start()
        return self.proc.pid

    def read_log(self, offset: int, max_bytes: int = LOG_CHUNK) -> bytes:
        """Up to `max_bytes` of the node's log from `offset` (b"" when caught up)."""
        try:
            with open(self.dir / "node.log", "rb") as f:
                f.seek(offset)
                return f.read(max_bytes)
        except OSError:
            return b""

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def signal(self, sig: int) -> None:
        if self.proc:
            self.proc.signal(sig)

    def stop(self, grace_s: float) -> int | None:
        return self.proc.stop(grace_s) if self.proc else None

    def tail(self, lines: int = 20) -> str:
        return self.proc.tail(lines) if self.proc else ""


class RayHandle:
    """A `Handle` (cluster/supervisor.py) whose process lives in a `NodeActor`."""

    def __init__(self, actor, args: list[str], log_path: str):
        """`log_path`: where the node's log is collected on the launcher's machine."""
        self.actor, self.args, self.log_path = actor, args, log_path
        self.pid: int | None = None
        self._log_offset = 0  # bytes of the actor's log copied so far
        self._next_pull = 0.0

    def _get(self, ref, timeout_s: float = 30.0):
        import ray

        return ray.get(ref, timeout=timeout_s)

    def start(self) -> None:
        import ray

        try:
            self.pid = self._get(self.actor.start.remote(self.args))
        except ray.exceptions.RayActorError as e:
            raise LaunchError(f"its Ray actor is gone, with the host it ran on ({e})") from None

    def poll(self) -> int | None:
        """None while running, or while its host does not answer (a network cut is not a
        lost host); -1 once Ray declares the actor dead (its node died or was lost)."""
        import ray

        if time.monotonic() >= self._next_pull:
            self._next_pull = time.monotonic() + LOG_PULL_S
            self.collect_log()
        try:
            return self._get(self.actor.poll.remote(), timeout_s=POLL_TIMEOUT_S)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return None  # unreachable for now: Ray tells when it is dead
        except ray.exceptions.RayActorError:
            return -1  # the actor (and with it the node) is gone

    def signal(self, sig: int) -> None:
        self.actor.signal.remote(sig)

    def stop(self, grace_s: float) -> int | None:
        import ray

        try:
            code = self._get(self.actor.stop.remote(grace_s), timeout_s=grace_s + 30)
        except (ray.exceptions.RayError, TimeoutError):
            code = None
        self.collect_log(everything=True)
        return code

    def collect_log(self, everything: bool = False) -> int:
        """Append what the node logged since the last call to `log_path` here; bytes
        copied. One chunk, or (`everything`) until caught up; a host that does not
        answer is skipped (its log catches up on a later call)."""
        copied = 0
        while True:
            try:
                chunk = self._get(
                    self.actor.read_log.remote(self._log_offset), timeout_s=POLL_TIMEOUT_S
                )
            except Exception:  # unreachable or gone: what was copied stays
                return copied
            if chunk:
                with open(self.log_path, "ab") as f:
                    f.write(chunk)
                self._log_offset += len(chunk)
                copied += len(chunk)
            if not everything or len(chunk) < LOG_CHUNK:
                return copied

    def tail(self, lines: int = 20) -> str:
        try:
            return self._get(self.actor.tail.remote(lines))
        except Exception as e:
            copied = log_tail(self.log_path, lines)  # what was collected before
            return f"(log unavailable: {e}; collected:)\n{copied}"


def ray_options(group) -> dict:
    """The Ray resources one node of `group` reserves: its `ray` section, and at least one
    CPU (or GPU, on CUDA) per tensor-parallel rank."""
    r, tp = group.ray, group.tensor_parallel_size
    devices = group.device if isinstance(group.device, list) else [group.device]
    cuda = any(d.startswith("cuda") for d in devices)
    return dict(
        num_cpus=r.num_cpus if cuda else max(r.num_cpus, tp),
        num_gpus=max(r.num_gpus, tp) if cuda else r.num_gpus,
        resources=dict(r.resources),
    )


def place_nodes(
    cfg: ClusterConfig, config_text: str, redis_password: str | None = None
) -> dict[str, tuple[object, dict]]:
    """One actor per node, placed by the group's resources: name -> (actor, where)."""
    import ray

    env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    if redis_password:  # by environment, never argv (pdserve/common/redis_auth.py)
        env[PASSWORD_ENV] = redis_password
    if "PYTHONPATH" not in env:
        env["PYTHONPATH"] = os.getcwd()
    remote = ray.remote(NodeActor)
    actors = {}
    for node in cluster_nodes(cfg):
        options = ray_options(node.group)
        actors[node.name] = remote.options(name=None, **options).remote(config_text, env)
    placed = {}
    for name, actor in actors.items():
        try:
            placed[name] = (actor, ray.get(actor.where.remote(), timeout=PLACEMENT_TIMEOUT_S))
        except ray.exceptions.GetTimeoutError:
            group = cfg.prefill if name.startswith("prefill") else cfg.decode
            raise LaunchError(
                f"{name}: no Ray node offers {ray_options(group)} within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s (see `ray status`)"
            ) from None
    return placed


def ray_services(
    cfg: ClusterConfig, config_file: str, overrides: list[str], run_dir: Path, state: ClusterState
) -> list[list[Service]]:
    """Stages: [local redis], [nodes in Ray actors], [local router]."""
    try:
        import ray
    except ImportError:
        raise LaunchError(
            "launcher.kind is ray but ray is not installed: pip install ray"
        ) from None

    ray.init(address=cfg.launcher.ray_address, log_to_driver=False, logging_level="WARNING")
    state.cleanups.append(ray.shutdown)  # ends the actors (and any node they still run)
    config_text = Path(config_file).read_text()
    stages, node_overrides = redis_stage(cfg, run_dir, state, overrides)
    placed = place_nodes(cfg, config_text, state.redis_password)
    for role in ("prefill", "decode"):
        group = getattr(cfg, role)
        if group is None or not group.count:
            continue
        hosts = [group.host] * group.count if isinstance(group.host, str) else group.host
        resolved = [
            placed[f"{role}-{i}"][1]["ip"] if h == "auto" else h for i, h in enumerate(hosts)
        ]
        node_overrides.append(f"{role}.host=[{', '.join(resolved)}]")
    from pdserve.cluster.config_file import load_config

    resolved_cfg = load_config(config_file, node_overrides)
    nodes = cluster_nodes(resolved_cfg)
    services = []
    for node in nodes:
        actor, where = placed[node.name]
        args = serve_argv(config_file, node, node_overrides, log_level=cfg.launcher.log_level)
        args = args[args.index("--node") :]  # the actor supplies python and its config copy
        log = str(run_dir / f"{node.name}.log")
        handle = RayHandle(actor, args, log)
        svc = Service(node.name, node.role, handle, http_healthy(node.url), node.url, log)
        svc.where = where
        services.append(svc)
    stages.append(services)
    stages += router_stage(resolved_cfg, nodes, run_dir, state)
    return stages

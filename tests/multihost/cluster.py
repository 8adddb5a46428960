"""configs/multihost-ray.yaml launched on harness hosts (tests/multihost/hosts.py).

h1 runs the Ray head, redis-server (with a password: it serves other hosts) and `pdserve
launch` (the Ray driver, with the router as its child); h2 a Ray worker offering `prefill_host`, h3 one offering `decode_host`.
The shipped file is the base; the test changes only what this machine decides: the hosts'
addresses, the model, the secret, the run directory and shorter timeouts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import yaml

from pdserve.api.cluster_secret import NODE_KEY_HEADER, node_key
from tests.multihost.hosts import HostProcess, Hosts, faketime_env
from tests.servers import ROOT, launcher_state

SHIPPED = ROOT / "configs" / "multihost-ray.yaml"
RAY_PORT = 6379
# Ray's own listeners other than the runtime-env agent bind every address of their host
# (Ray 2.60 has no flag for that; docs/operations.md "Multi-host"): their ports are pinned so
# that a firewall can hold them and the bind check knows them. Workers (and the driver) take
# their gRPC port from WORKER_PORTS.
RAY_PORTS = {"node_manager": 6381, "object_manager": 6382, "autoscaler_metrics": 6383}
WORKER_PORTS = (10002, 10999)
ROLES = {"h1": "head", "h2": "prefill_host", "h3": "decode_host"}


def ray_cmd() -> list[str]:
    """The `ray` command of the python running the tests (its entry point, found by import)."""
    return [
        sys.executable,
        "-c",
        "import sys; from ray.scripts.scripts import main; sys.exit(main())",
    ]


class MultiHostCluster:
    """The Ray cluster and `pdserve launch` on `hosts` (h1..h3); `stop()` ends all of it."""

    def __init__(
        self,
        hosts: Hosts,
        run_root: Path,
        model: str,
        patch: dict | None = None,
        clock_offsets: dict[str, str] | None = None,
    ):
        """`clock_offsets`: host -> a libfaketime offset ("+5h") for every process of that
        host's Ray worker (so its node processes too); `set_clock_offset` changes it for
        the processes started after."""
        self.hosts, self.run_root = hosts, run_root
        self.clock_offsets = dict(clock_offsets or {})
        self.ray: list[HostProcess] = []
        self.launcher: HostProcess | None = None
        self.redis: HostProcess | None = None
        secret = os.urandom(24).hex().encode()
        (run_root / "cluster.secret").write_bytes(secret)
        self.node_headers = {NODE_KEY_HEADER: node_key(secret)}
        head = hosts.addr("h1")
        cfg = yaml.safe_load(SHIPPED.read_text())
        cfg["cluster"] = f"mh{os.getpid()}"
        cfg["model"]["name"] = model
        cfg["secret_file"] = str(run_root / "cluster.secret")
        self.redis_password = os.urandom(12).hex()
        self.redis_port = int(cfg["redis"].rsplit(":", 1)[1])
        cfg["redis"] = f"redis://:{self.redis_password}@{head}:{self.redis_port}"
        cfg["router"]["host"] = head
        cfg["router"].update(health_interval_s=0.5, max_retries=2)
        cfg["launcher"].update(
            ray_address=f"{head}:{RAY_PORT}",
            run_dir=str(run_root),
            log_level="warning",
            drain_timeout_s=3,
            restart={"backoff_s": 0.5, "max_restarts": 3},
        )
        for key, value in (patch or {}).items():
            section = cfg.setdefault(key, {})
            for k, v in value.items():
                section[k] = {**section.get(k, {}), **v} if isinstance(v, dict) else v
        self.config = cfg
        self.config_path = run_root / "multihost.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.env = {
            **os.environ,
            "RAY_memory_monitor_refresh_ms": "0",  # Ray's OOM killer judges the whole box
            "RAY_USAGE_STATS_ENABLED": "0",
            "AUTOSCALER_METRIC_PORT": str(RAY_PORTS["autoscaler_metrics"]),
            "PYTHONPATH": str(ROOT),
            # Hosts on one machine: UCX would move KV through its shared-memory transports
            # across namespaces; TCP only makes it cross the veth links like between machines.
            "UCX_TLS": "tcp",
        }

    # -- start and stop ------------------------------------------------------------------
    def start(self) -> None:
        temp = f"/tmp/ray-{self.hosts.prefix}"  # short: Ray's socket paths must fit
        head = self.hosts.addr("h1")
        common = ["start", "--block", "--disable-usage-stats",
                  "--node-manager-port", str(RAY_PORTS["node_manager"]),
                  "--object-manager-port", str(RAY_PORTS["object_manager"]),
                  "--min-worker-port", str(WORKER_PORTS[0]),
                  "--max-worker-port", str(WORKER_PORTS[1])]  # fmt: skip
        self.ray.append(self.hosts.run(
            "h1", [*ray_cmd(), *common, "--head", "--include-dashboard", "false", "--node-ip-address", head,
                   "--port", str(RAY_PORT), "--num-cpus", "0", "--temp-dir", f"{temp}-h1"],
            env=self.env, log=self.run_root / "ray-h1.log",
        ))  # fmt: skip
        self._wait_ray_head()
        for host, resource in list(ROLES.items())[1:]:
            env = self.env
            if host in self.clock_offsets:
                self.set_clock_offset(host, self.clock_offsets[host])
                env = {**env, **faketime_env(self.clock_file(host))}
            self.ray.append(self.hosts.run(
                host, [*ray_cmd(), *common, "--address", f"{head}:{RAY_PORT}",
                       "--node-ip-address", self.hosts.addr(host), "--num-cpus", "1",
                       "--resources", json.dumps({resource: 1}),
                       "--temp-dir", f"{temp}-{host}"],  # one filesystem: its own sockets
                env=env, log=self.run_root / f"ray-{host}.log",
            ))  # fmt: skip
        self.redis = self.hosts.run("h1", [
            "redis-server", "--bind", head, "--port", str(self.redis_port), "--save", "",
            "--appendonly", "no", "--requirepass", self.redis_password, "--dir", str(self.run_root),
        ], log=self.run_root / "redis.log")  # fmt: skip
        cmd = [sys.executable, "-m", "pdserve", "launch", str(self.config_path)]
        self.launcher = self.hosts.run(
            "h1", cmd, env=self.env, cwd=ROOT, log=self.run_root / "launcher.out"
        )

    def clock_file(self, host: str) -> Path:
        return self.run_root / f"clock-{host}.faketime"

    def set_clock_offset(self, host: str, offset: str) -> None:
        """The clock offset of the processes started on `host` from now on."""
        self.clock_file(host).write_text(offset + "\n")

    def _wait_ray_head(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.hosts.check("h1", [sys.executable, "-c", _PORT_OPEN,
                                        self.hosts.addr("h1"), str(RAY_PORT)])  # fmt: skip
                return
            except Exception:
                assert time.monotonic() < deadline, self.log("ray-h1.log")
                time.sleep(0.3)

    def stop(self) -> None:
        if self.launcher and self.launcher.poll() is None:
            self.launcher.signal(signal.SIGTERM)
            try:
                self.launcher.wait(60)
            except Exception:
                pass
            self.launcher.stop(0)
        for proc in reversed(self.ray):
            proc.stop(grace_s=5)
        if self.redis:
            self.redis.stop(grace_s=2)

    # -- state ---------------------------------------------------------------------------
    def log(self, name: str) -> str:
        try:
            return (self.run_root / name).read_text()[-4000:]
        except OSError:
            return ""

    def state(self) -> dict:
        return launcher_state(self.run_root, self.config["cluster"])

    def service(self, name: str) -> dict:
        return next(s for s in self.state()["services"] if s["name"] == name)

    def wait_up(self, names: set[str], timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.launcher.poll() is None, f"launcher exited:\n{self.log('launcher.out')}"
            for proc in self.ray:
                assert proc.poll() is None, (
                    f"ray on {proc.host} exited: {self.log(f'ray-{proc.host}.log')}"
                )
            services = self.state()["services"]
            if {s["name"] for s in services} >= names and all(
                s["state"] == "up" for s in services if s["name"] in names
            ):
                return
            assert time.monotonic() < deadline, f"not up in {timeout_s} s: {services}"
            time.sleep(0.5)

    @property
    def router_url(self) -> str:
        return self.state()["router_url"]

    def engine(self, name: str, timeout_s: float = 10) -> dict:
        url = f"{self.service(name)['url']}/debug/engine"
        return httpx.get(url, headers=self.node_headers, timeout=timeout_s).json()


_PORT_OPEN = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 2)"

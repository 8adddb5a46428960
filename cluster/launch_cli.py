"""`pdserve launch CONFIG`: bring a whole cluster up from one YAML file, and down on Ctrl-C.

The config is checked completely (and, for the local launcher, every port it binds) before
any process starts; then `launcher.kind` picks the local launcher (cluster/launcher.py) or
the Ray launcher (cluster/ray_launcher.py). Exit code 2: invalid config; 1: a process did
not come up; 0: stopped by SIGINT/SIGTERM after draining.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.cluster.config_file import ConfigFileError, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pdserve launch`: start every process of a cluster config and supervise them."""
    p.add_argument("config", help="cluster YAML file, e.g. configs/local.yaml")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set router.port=9000 (repeatable)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the launcher's own log level (its processes use launcher.log_level)",
    )


def run(args: argparse.Namespace) -> None:
    try:
        cfg = load_config(args.config, args.set)
        if cfg.launcher.kind == "ray":
            from pdserve.cluster.launcher import run_cluster
            from pdserve.cluster.ray_launcher import ray_services

            code = run_cluster(cfg, args.config, args.set, build=ray_services)
        else:
            from pdserve.cluster.launcher import run_cluster

            code = run_cluster(cfg, args.config, args.set)
    except ConfigFileError as e:
        print(f"pdserve launch: invalid config, nothing was started:\n{e}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(code)

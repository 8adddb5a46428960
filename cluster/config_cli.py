"""`pdserve config check FILE`: validate a cluster config without starting anything;
`pdserve config docs [--write]`: the field reference in docs/configuration.md."""

from __future__ import annotations

import argparse
import sys

from pdserve.cluster.config_file import ConfigFileError, load_config
from pdserve.common.redis_auth import redact


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pdserve config`: check a cluster config, or print the field reference."""
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = sub.add_parser("check", help="validate a cluster config file (starts nothing)")
    check.add_argument("config", help="cluster YAML file")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    docs = sub.add_parser("docs", help="print the config reference (markdown)")
    docs.add_argument("--write", action="store_true", help="update docs/configuration.md")


def run(args: argparse.Namespace) -> None:
    if args.action == "docs":
        from pdserve.cluster.docs import reference, update_docs_file

        if args.write:
            update_docs_file()
        else:
            print(reference())
        return
    try:
        cfg = load_config(args.config, args.set)
    except ConfigFileError as e:
        print(f"{e}", file=sys.stderr)
        raise SystemExit(2) from None
    from pdserve.cluster.checks import insecure_warning
    from pdserve.cluster.nodes import cluster_nodes

    nodes = cluster_nodes(cfg)
    print(
        f"{args.config}: ok (cluster '{cfg.cluster}', model {cfg.model.name}, launcher "
        f"{cfg.launcher.kind}, redis {redact(cfg.redis.url)})"
    )
    for node in nodes:
        extra = f" kv {node.control_address}" if node.control_address else ""
        print(f"  {node.name:<10} {node.url}{extra} device {node.device}")
    if cfg.router.enabled:
        print(f"  {'router':<10} http://{cfg.router.host}:{cfg.router.port}")
    if warning := insecure_warning(cfg):
        print(warning, file=sys.stderr)

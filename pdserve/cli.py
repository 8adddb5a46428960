"""`pdserve SUBCOMMAND ...`: dispatch to the module that owns the subcommand.

A subcommand module exposes `add_arguments(parser)` and `run(args)`; its docstring's first
line is the help text. Modules are imported lazily: only the chosen one is loaded.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pdserve.common.stack_dump import install_on_sigusr1

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdserve.node.cli", "serve one model over HTTP (colocated, prefill or decode node)"),
    "bench": (
        "pdserve.bench.cli",
        "benchmarks: serve (any OpenAI endpoint), kv (NIXL transfers), compare",
    ),
    "launch": ("pdserve.cluster.launch_cli", "launch a whole cluster from one YAML file"),
    "config": ("pdserve.cluster.config_cli", "check a cluster config file, or print its reference"),
    "status": ("pdserve.cluster.status", "show a running cluster (processes, health, registry)"),
    "restart": (
        "pdserve.cluster.restart_cli",
        "restart a launched cluster's nodes one at a time, their streams moved elsewhere",
    ),
    "router": (
        "pdserve.router.cli",
        "the cluster's front door: OpenAI API over prefill/decode nodes",
    ),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="pdserve", description="pdserve: prefill/decode disaggregated LLM serving"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args, rest = parser.parse_known_args(argv)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    install_on_sigusr1()  # `kill -USR1 PID`: where every thread and task is, in the log
    level = getattr(args, "log_level", "info")
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    importlib.import_module(SUBCOMMANDS[args.command][0]).run(args)


if __name__ == "__main__":
    main()

"""`pdserve bench serve | kv | kv-store | compare`: benchmarks (see each module's docstring)."""

from __future__ import annotations

import argparse
import importlib

# name -> (module, one-line help); modules are imported only when chosen
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "pdserve.bench.serve",
        "load an OpenAI-compatible endpoint: TTFT, TPOT, ITL, goodput",
    ),
    "kv": ("pdserve.bench.kv", "KV-block NIXL transfers between two processes or two hosts"),
    "kv-store": (
        "pdserve.bench.kv_store",
        "LMCache store/retrieve through Redis vs redis-py SET/GET",
    ),
    "compare": ("pdserve.bench.compare", "two `bench serve` reports side by side"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pdserve bench`: serving and KV-transfer benchmarks."""
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, (module, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_)
        importlib.import_module(module).add_arguments(sp)
        sp.add_argument(
            "--log-level", default="info", choices=["debug", "info", "warning", "error"]
        )


def run(args: argparse.Namespace) -> None:
    importlib.import_module(COMMANDS[args.bench_command][0]).run(args)

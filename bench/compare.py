"""`pdserve bench compare A.json B.json`: two serving runs side by side, with B/A ratios.

Runs are paired by position (first rate of A with first rate of B, ...). Works on any two
`pdserve bench serve` reports: colocated vs PD, pdserve vs vLLM (both measured by
`pdserve bench serve`), before vs after a change.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdserve.bench.report import compare_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=Path, help="first report (A)")
    p.add_argument("b", type=Path, help="second report (B)")


def load(path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"pdserve bench compare: cannot read {path}: {e}") from None
    if not isinstance(report, dict) or not isinstance(report.get("runs"), list):
        raise SystemExit(f"pdserve bench compare: {path} is not a bench serve report")
    return report


def run(args: argparse.Namespace) -> None:
    print(compare_table(load(args.a), load(args.b)))

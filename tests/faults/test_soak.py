"""benchmarks/soak.py in its short CI mode: a tiny-model cluster under mixed load with
client aborts and a prefill node SIGKILLed midway; it exits 0 only with no leaked block
and every request answered, and writes its JSON report and PNG."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.servers import ROOT

pytestmark = [pytest.mark.faults]
pytest.importorskip("nixl")


def test_soak_short_mode(tmp_path):
    out = tmp_path / "soak"
    cmd = [sys.executable, "benchmarks/soak.py", "--duration-s", "20", "--model", "tiny"]
    cmd += ["--clients", "4", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["leaked_blocks"] == 0 and report["without_terminal_answer"] == 0
    assert report["completed"] > 0 and report["disconnected_by_client"] > 0
    assert report["sent"] == (
        report["completed"] + report["disconnected_by_client"]
        + sum(report["failed_by_reason"].values())
    )  # fmt: skip
    assert out.with_suffix(".png").stat().st_size > 10_000

"""`pdserve restart` (cluster/restart_cli.py): which nodes a name picks, and what it refuses.
The rolling restart itself runs on a launched cluster under load in
tests/faults/test_migration.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.cluster.restart_cli import chosen
from tests.servers import ROOT

SERVICES = [
    {"name": "redis", "kind": "redis"},
    {"name": "prefill-0", "kind": "prefill"},
    {"name": "decode-0", "kind": "decode"},
    {"name": "decode-1", "kind": "decode"},
    {"name": "router", "kind": "router"},
]


def names(picked: list[dict]) -> list[str]:
    return [s["name"] for s in picked]


def test_a_group_picks_its_nodes_in_order_and_a_node_itself():
    assert names(chosen(SERVICES, ["decode"])) == ["decode-0", "decode-1"]
    assert names(chosen(SERVICES, ["decode-1", "prefill"])) == ["decode-1", "prefill-0"]
    assert names(chosen(SERVICES, ["decode-0", "decode"])) == ["decode-0", "decode-1"]


@pytest.mark.parametrize("name", ["router", "redis", "decode-7", "dec"])
def test_what_is_not_a_node_is_refused_naming_the_nodes(name):
    with pytest.raises(SystemExit, match=f"no node or group '{name}'.*decode-0, decode-1"):
        chosen(SERVICES, [name])


def restart(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pdserve", "restart", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_no_cluster_and_a_ray_cluster_are_refused(tmp_path):
    done = restart("decode", "--run-dir", str(tmp_path))
    assert done.returncode == 1 and "no cluster.json under" in done.stderr
    run = tmp_path / "c1-latest"
    run.mkdir()
    state = {"cluster": "c1", "launcher": "ray", "services": SERVICES}
    (run / "cluster.json").write_text(json.dumps(state))
    done = restart("decode", "--run-dir", str(tmp_path))
    assert done.returncode == 1 and "ray launcher's nodes run on other hosts" in done.stderr
    state["launcher"] = "local"
    (run / "cluster.json").write_text(json.dumps(state | {"services": SERVICES[:1]}))
    done = restart("decode", "--run-dir", str(tmp_path))
    assert done.returncode == 1 and "no node or group 'decode' (nodes: none)" in done.stderr
    # the only node of its kind: nothing would take its streams
    (run / "cluster.json").write_text(json.dumps(state | {"services": SERVICES[:3]}))
    done = restart("prefill", "--run-dir", str(tmp_path))
    assert done.returncode == 1 and "prefill-0 is the only prefill node" in done.stderr

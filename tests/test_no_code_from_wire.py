"""Nothing received is ever run: no pickle (or its relatives), eval, exec or unsafe loads
anywhere outside the tests. Scans the syntax tree of every shipped module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["pdserve", "bench", "api", "node", "router", "cluster", "engine", "prefill"]
PACKAGES += ["decode", "kv_transfer", "kernels", "benchmarks"]
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
BANNED_METHODS = {"recv_pyobj", "send_pyobj", "loads_pickle"}


def findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where} import {a.name}" for a in node.names if a.name in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module in BANNED_MODULES:
            out.append(f"{where} from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in BANNED_CALLS:
                out.append(f"{where} {f.id}()")
            elif isinstance(f, ast.Attribute) and f.attr in BANNED_METHODS:
                out.append(f"{where} .{f.attr}()")
            elif isinstance(f, ast.Attribute) and f.attr == "load" and _is(f.value, "torch"):
                safe = any(
                    k.arg == "weights_only" and getattr(k.value, "value", None) is True
                    for k in node.keywords
                )
                if not safe:
                    out.append(f"{where} torch.load without weights_only=True")
            elif isinstance(f, ast.Attribute) and f.attr == "load" and _is(f.value, "yaml"):
                out.append(f"{where} yaml.load (use yaml.safe_load)")
    return out


def _is(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def test_no_pickle_eval_or_exec_in_shipped_code():
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 50  # the scan really covers the code
    bad = [f for p in files for f in findings(p)]
    assert bad == [], "\n".join(bad)


def test_the_scan_catches_what_it_bans(tmp_path):
    src = tmp_path / "bad.py"
    src.write_text(
        "import pickle\nfrom marshal import loads\nimport torch, yaml\n"
        "eval('1')\nexec('x=1')\nsock.recv_pyobj()\ntorch.load('f')\nyaml.load(s)\n"
        "torch.load('f', weights_only=True)\n"
    )
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        got = findings(src)
    finally:
        ROOT = old
    assert len(got) == 7, got

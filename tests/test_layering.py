"""Every import arrow in the product points down the layers, and no two files import each other.

Layers, bottom up: pdserve.common (the shared floor) < pdserve.config < kernels < engine <
kv_transfer < prefill, decode < node; common < api < node, router; common < cluster < node,
router, bench. `ALLOWED` below is that table: what each layer may import. Imports are read
with `ast` from every product file: module-level, inside functions (lazy imports count)
and in string constants (code a child process runs with `python -c`).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("api", "bench", "cluster", "decode", "engine", "kernels", "kv_transfer", "node")
FOLDERS += ("prefill", "router")

_LOW = {"common", "config"}
_ENGINE = _LOW | {"kernels", "engine"}
_PD = _ENGINE | {"kv_transfer"}
ALLOWED: dict[str, set[str]] = {
    "common": {"common"},
    "config": _LOW,
    "kernels": _LOW | {"kernels"},
    "engine": _ENGINE,
    "kv_transfer": _PD,
    "prefill": _PD | {"prefill"},
    "decode": _PD | {"decode"},
    "api": {"common", "api"},
    "cluster": _LOW | {"cluster"},
    "router": _LOW | {"api", "cluster", "router"},
    "bench": _PD | {"api", "cluster", "bench"},
    "node": _PD | {"prefill", "decode", "api", "cluster", "node"},
    "cli": _PD | {"prefill", "decode", "api", "cluster", "node", "router", "bench", "cli"},
}
_CODE_IMPORT = re.compile(r"(?:from|import)\s+(pdserve(?:\.\w+)*)")


def product_files() -> dict[str, Path]:
    """Module name -> file, for every product file."""
    out = {}
    roots = [(ROOT / f, f"pdserve.{f}") for f in FOLDERS] + [(ROOT / "pdserve", "pdserve")]
    for base, pkg in roots:
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            name = ".".join((pkg, *rel))
            out[name.removesuffix(".__init__")] = path
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and (parts[1] in FOLDERS or parts[1] in _LOW):
        return parts[1]
    return "cli"  # pdserve/__init__, __main__, cli: the command on top of everything


class Imports:
    """The import edges of every product file, by kind."""

    def __init__(self):
        self.files = product_files()
        self.module_level: dict[str, set[str]] = defaultdict(set)
        self.lazy: dict[str, set[str]] = defaultdict(set)  # in functions or code strings
        for mod, path in self.files.items():
            self._scan(mod, path)

    def resolve(self, name: str) -> str | None:
        while name and name not in self.files:
            name = name.rpartition(".")[0]
        return name or None

    def _add(self, mod: str, target: str, lazy: bool) -> None:
        t = self.resolve(target)
        if t is not None and t != mod:
            (self.lazy if lazy else self.module_level)[mod].add(t)

    def _scan(self, mod: str, path: Path) -> None:
        is_pkg = path.name == "__init__.py"

        def visit(node: ast.AST, in_fn: bool) -> None:
            for ch in ast.iter_child_nodes(node):
                lazy = in_fn or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(ch, ast.Import):
                    for a in ch.names:
                        self._add(mod, a.name, lazy)
                elif isinstance(ch, ast.ImportFrom):
                    base = ch.module or ""
                    if ch.level:
                        pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                        pkg = pkg[: len(pkg) - ch.level + 1]
                        base = ".".join(pkg + ([base] if base else []))
                    for a in ch.names:
                        self._add(mod, f"{base}.{a.name}", lazy)
                elif isinstance(ch, ast.Constant) and isinstance(ch.value, str):
                    for target in _CODE_IMPORT.findall(ch.value):
                        self._add(mod, target, True)
                visit(ch, lazy)

        visit(ast.parse(path.read_text(), str(path)), False)


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


IMPORTS = Imports()


def test_the_scan_sees_the_product():
    assert len(IMPORTS.files) > 100
    assert "pdserve.common.errors" in IMPORTS.files
    # a lazy import and a code-string import are both seen
    assert "pdserve.common.model_files" in IMPORTS.lazy["pdserve.cluster.checks"]
    assert "pdserve.common.model_files" in IMPORTS.lazy["pdserve.router.tokenizer"]


def test_every_arrow_points_down():
    up = []
    for kind, edges in (("module", IMPORTS.module_level), ("lazy", IMPORTS.lazy)):
        for mod, targets in sorted(edges.items()):
            for t in sorted(targets):
                if layer(t) not in ALLOWED[layer(mod)]:
                    up.append(f"{mod} -> {t} ({kind}: {layer(mod)} may not import {layer(t)})")
    assert not up, "imports pointing up:\n" + "\n".join(up)


def test_no_import_cycle_between_files():
    assert cycles(IMPORTS.module_level) == [], "files importing each other at module level"
    both = defaultdict(set)
    for edges in (IMPORTS.module_level, IMPORTS.lazy):
        for mod, targets in edges.items():
            both[mod] |= targets
    assert cycles(both) == [], "files importing each other through function-level imports"


def test_router_cluster_and_common_load_no_torch():
    light = ["pdserve.router.app", "pdserve.router.cli", "pdserve.cluster", "pdserve.api"]
    light += [m for m in IMPORTS.files if m.startswith("pdserve.common")]
    code = (
        f"import importlib, sys\nfor m in {light!r}:\n    importlib.import_module(m)\n"
        "heavy = [m for m in ('torch', 'transformers', 'pdserve.engine') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr

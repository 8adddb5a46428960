"""One installed namespace: the wheel puts `pdserve` and nothing else into site-packages, and
no code of the project imports its folders by their bare names (`engine`, `router`, ...),
which would load a second copy of a module beside `pdserve.engine`."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the repository's top-level folders that are subpackages of pdserve (pyproject.toml)
FOLDERS = "api bench cluster decode engine kernels kv_transfer node prefill router".split()
CODE_DIRS = ["pdserve", *FOLDERS, "benchmarks", "tests"]


def _bare(name: str | None) -> bool:
    return name is not None and name.split(".")[0] in FOLDERS


def test_no_bare_imports_of_the_folders():
    bad = []
    for d in CODE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    # code run as a string (python -c, a child's import list)
                    names = re.findall(r"(?:^|\n|;)\s*(?:from|import) ([\w.]+)", node.value)
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if _bare(n)]
    for path in sorted((ROOT / "scripts").glob("*.sh")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for n in re.findall(r"(?:from|import|-m) ([\w.]+)", line):
                if _bare(n) and "." in n:
                    bad.append(f"{path.relative_to(ROOT)}:{i} {n}")
    assert not bad, "import pdserve.<folder>, not the bare folder:\n" + "\n".join(bad)


def test_the_wheel_installs_pdserve_alone(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("pdserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"pdserve"}, tops
    assert "pdserve/kernels/csrc/gemm_packed.cpp" in names  # the sources built on first use
    assert "pdserve/engine/models/llama.py" in names and "pdserve/router/app.py" in names
    assert not any(n.startswith("pdserve/benchmarks") or "tests/" in n for n in names)

    # a fresh venv with the wheel alone: its site-packages holds pdserve and nothing else
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
         str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (site,) = venv.glob("lib/python*/site-packages")
    installed = {p.name for p in site.iterdir() if not p.name.endswith(".dist-info")}
    assert installed == {"pdserve"}, installed
    probe = (
        "import importlib.util as u, json; "
        "print(json.dumps([u.find_spec(n) is not None for n in "
        "['pdserve', 'engine', 'router', 'kernels', 'api', 'node']]))"
    )
    out = subprocess.run(
        [str(py), "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[true, false, false, false, false, false]", out.stdout

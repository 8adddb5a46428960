"""The kernel contract's shape: the engine imports `pdserve.kernels.ops` only (hugepages and
fault_in, memory utilities, aside); each C++ source has its wrapper of the same name and its entry
points declared in kernels/native.py; every op set offers every op of the reference."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from pdserve.kernels import cpu_ops, native
from pdserve.kernels import reference as ref

ROOT = Path(__file__).resolve().parent.parent
# the contract, and two memory utilities (huge pages; the KV cache's background fault-in)
ALLOWED = {"pdserve.kernels.ops", "pdserve.kernels.hugepages", "pdserve.kernels.fault_in"}


def _kernel_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "pdserve.kernels":
                found |= {f"pdserve.kernels.{a.name}" for a in node.names}
            elif node.module.startswith("pdserve.kernels"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pdserve.kernels")}
    return found


def test_the_engine_imports_only_the_contract():
    for path in sorted((ROOT / "engine").rglob("*.py")):
        extra = _kernel_imports(path) - ALLOWED
        assert not extra, f"{path.relative_to(ROOT)} imports {sorted(extra)}"


def test_each_source_has_its_wrapper_and_declared_signatures():
    sources = {p.stem for p in (ROOT / "kernels" / "csrc").glob("*.cpp")}
    assert sources == set(native.SIGNATURES)
    for name in sources:
        assert (ROOT / "kernels" / f"{name}.py").exists(), f"no wrapper kernels/{name}.py"
        text = (ROOT / "kernels" / "csrc" / f"{name}.cpp").read_text()
        for fn in native.SIGNATURES[name]:
            assert f" {fn}(" in text, f"{fn} is not defined in {name}.cpp"


def test_every_op_set_offers_the_reference_ops():
    ops = [n for n, f in inspect.getmembers(ref, inspect.isfunction)
           if not n.startswith("_") and f.__module__ == ref.__name__]  # fmt: skip
    assert {"norm_linear", "gate_up_silu", "paged_decode_attention"} <= set(ops)
    for name in ops:
        assert inspect.signature(getattr(cpu_ops, name)) == inspect.signature(getattr(ref, name))
    assert cpu_ops.FUSES_MLP_ACTIVATION and not ref.FUSES_MLP_ACTIVATION

"""Shared fixtures: tiny random-weight Llama models for fast tests."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import re
import socket
import threading
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Engines here barely touch their KV cache: faulting all of it in at each start
# (cache.kv_populate) would cost seconds per engine in a VM. tests/test_hugepages.py turns
# it back on where it tests it.
os.environ.setdefault("PDSERVE_KV_POPULATE", "0")
# Nor do they gain from huge pages, which cost most at start in a VM: a fresh 2 MiB page
# took ~9 ms to fault in on the 2-vCPU CI-type VM (its free huge blocks go back to the
# host), ~10 CPU-s and 12-20 s more for each node start (weights and packed weights).
# Servers and engines started by tests run on 4 KiB pages; the `huge_pages` fixture turns
# them back on for the tests of them (test_hugepages.py, test_fault_in.py).
os.environ.setdefault("PDSERVE_HUGEPAGES", "0")


@pytest.fixture
def huge_pages(monkeypatch):
    """Huge pages as a node has them by default (conftest turns them off for the rest)."""
    from pdserve.kernels import hugepages

    monkeypatch.delenv("PDSERVE_HUGEPAGES", raising=False)
    hugepages.available.cache_clear()
    yield
    monkeypatch.undo()
    hugepages.available.cache_clear()


# scripts/test.sh runs the suite on pytest-xdist workers (`--dist loadgroup`): the tests of
# one group run on one worker, one after another. A module is one group (its module-scoped
# fixtures, a served model or a cluster, are set up once, on one worker, as in a serial
# run), unless it names a shared group, `pytestmark = pytest.mark.xdist_group("NAME")`, for
# tests that must not run beside each other (README.md, "Tests"); every module under
# tests/multihost/ is in the group `multihost`. The groups are read here, from the modules'
# source: pytest-xdist 3.8 cannot see the marks under pytest 9 (it tags the tests' node ids,
# which pytest 9 no longer lets it change), so this conftest gives the scheduler itself.
_GROUP_MARK = re.compile(r"""xdist_group\(\s*(?:name\s*=\s*)?["']([^"']+)["']""")


@functools.cache
def module_group(root: Path, module: str) -> str:
    """The xdist group of the tests of `module` (a path relative to the rootdir)."""
    try:
        names = set(_GROUP_MARK.findall((root / module).read_text()))
    except OSError:
        names = set()
    if len(names) == 1:
        return names.pop()
    if len(names) > 1:
        raise pytest.UsageError(
            f"{module}: more than one xdist_group ({sorted(names)}): one a module"
        )
    return _default_group(module)


def _default_group(module: str) -> str:
    return "multihost" if module.startswith("tests/multihost/") else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # an xdist that tags the node ids
                return nodeid.rsplit("@", 1)[1]
            return module_group(config.rootpath, nodeid.split("::", 1)[0])

    return ModuleGroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """An xdist_group mark is the module's (`pytestmark`), never one test's: the scheduler
    reads it from the module's source."""
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        marks = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}  # fmt: skip
        group = module_group(config.rootpath, module)
        if marks != {group} if marks else group != _default_group(module):
            raise pytest.UsageError(
                f"{item.nodeid}: an xdist_group mark goes on the whole module "
                f"(pytestmark = pytest.mark.xdist_group(NAME)), not on one test"
            )


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its module fixtures gone): collect and hand freed heap
    memory back to the kernel. An xdist worker runs many modules that load models; glibc
    keeps their freed weights' heap pages, and three workers at 3-4.5 GB each beside the
    modules' servers were what the OOM killer ended on a 23 GiB box."""
    try:
        return (yield)
    finally:
        if nextitem is None or getattr(nextitem, "module", None) is not getattr(
            item, "module", None
        ):
            gc.collect()
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):  # not glibc
                pass


def skip_in_isa_view() -> None:
    """For a test that builds another CPU's kernels and runs them in a child process: under
    scripts/avx2_view.sh only the test process is emulated (the child would run natively,
    repeating what the main suite runs), so it is skipped there."""
    if os.environ.get("PDSERVE_ISA_VIEW"):
        pytest.skip("a native child process: the main suite runs it")


def make_tiny_llama(path: str, *, seed: int = 0, **overrides) -> str:
    """Write a random-weight Llama (HF format, safetensors, no tokenizer) to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    # Larger weights than the default init give peaked logits, so greedy choices are
    # stable against float noise (top-1/top-2 gaps well above 1e-2).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama with GQA (4 query heads, 2 KV heads) and tied embeddings."""
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture
def redis_server():
    """A real redis-server on a free loopback port, stopped after the test."""
    from pdserve.cluster.embedded_redis import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def hung_redis_url():
    """A TCP server that accepts connections and never answers (a hung Redis)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    conns = []

    def accept():
        with contextlib.suppress(OSError):
            while True:
                conns.append(srv.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield f"redis://127.0.0.1:{srv.getsockname()[1]}"
    srv.close()
    for c in conns:
        c.close()

"""Every way the native CPU kernel library cannot be located, built or loaded ends in the
logged fallback (`load_library` returns None, callers use the pure-torch reference),
never in an exception out of engine start-up. A compiler whose `--version` hangs is
given up on after `$PDSERVE_CXX_VERSION_TIMEOUT_S` seconds."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pdserve.kernels import native

TIMEOUT_ENV = "PDSERVE_CXX_VERSION_TIMEOUT_S"


def fake_compiler(tmp_path: Path, version_cmd: str) -> Path:
    """A `$CXX` that runs `version_cmd` for `--version` and fails every compile."""
    cxx = tmp_path / "oddcxx"
    cxx.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then {version_cmd}; fi\nexit 1\n')
    cxx.chmod(0o755)
    return cxx


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))


def load_uncached(name: str, caplog) -> object:
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels.native"):
        return native.load_library.__wrapped__(name)


def test_hanging_compiler_version_falls_back(monkeypatch, tmp_path, fresh_cache, caplog):
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, "exec sleep 40")))
    monkeypatch.setenv(TIMEOUT_ENV, "0.5")
    assert load_uncached("elementwise", caplog) is None
    assert "--version" in caplog.text and "pure-torch reference" in caplog.text


def test_undecodable_compiler_version_falls_back(monkeypatch, tmp_path, fresh_cache, caplog):
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, r"printf '\377\376 cc 1.0\n'; exit 0")))
    assert load_uncached("elementwise", caplog) is None  # its compile fails: logged
    assert "failed" in caplog.text and "pure-torch reference" in caplog.text


def test_bad_version_timeout_setting_falls_back_naming_it(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, "echo cc 1.0; exit 0")))
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    assert load_uncached("elementwise", caplog) is None
    assert TIMEOUT_ENV in caplog.text


def test_unusable_cache_dir_falls_back(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("where the cache directory would go")
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, "echo cc 1.0; exit 0")))
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(blocker / "cache"))
    assert load_uncached("elementwise", caplog) is None
    assert "pure-torch reference" in caplog.text

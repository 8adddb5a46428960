"""Builds the C++ CPU kernels (kernels/csrc/*.cpp) into shared libraries, once per machine.

Each source is compiled by the system C++ compiler (`$CXX`, else g++/c++) with
`-O3 -march=native -fopenmp` into a cache directory (`$PDSERVE_KERNEL_CACHE`, else
`$PDSERVE_CACHE_DIR/kernels`, else `~/.cache/pdserve/kernels`), under a name that hashes the source, the flags, the compiler
and this CPU's feature flags, so a cache shared between machines never serves a library
built for another CPU. The build takes about a second (plain C++, no torch headers) and
is atomic (temp file + rename), so concurrent processes are safe. The library is loaded
with ctypes after torch, so its OpenMP runtime is torch's own (same soname, one thread
pool). No compiler, a failed build, or any other failure to locate, build or load the
library (a `$CXX --version` that hangs past `$PDSERVE_CXX_VERSION_TIMEOUT_S`, default 10 s,
or prints undecodable text): `load_library` returns None with the reason in the
log, and callers fall back to the pure-torch reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first: the kernels share its thread pool)

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
# Per-source additions: the elementwise ops round like torch's separate ops (no FMA fusion);
# attention's dot products and accumulations use FMAs.
EXTRA_FLAGS = {"elementwise": ["-ffp-contract=off"], "paged_decode": ["-ffp-contract=fast"]}
BUILD_TIMEOUT_S = 300.0
# `$CXX --version` (hashed into the library name) answers in milliseconds; one that hangs
# is given up on after this many seconds (default 10) and the reference is used.
VERSION_TIMEOUT_ENV = "PDSERVE_CXX_VERSION_TIMEOUT_S"


def cache_dir() -> Path:
    env = os.environ.get("PDSERVE_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(base) / "kernels"


def find_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _compiler_version(cxx: str) -> str:
    raw = os.environ.get(VERSION_TIMEOUT_ENV) or "10"
    try:
        timeout = float(raw)
    except ValueError:
        raise RuntimeError(f"{VERSION_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    try:
        out = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, errors="replace", timeout=timeout
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{cxx} --version: {e}") from e
    return out.stdout.splitlines()[0] if out.stdout else cxx


def flags(name: str) -> list[str]:
    """The compiler flags for `name`; `$PDSERVE_KERNEL_MARCH` (e.g. `haswell`: AVX2, no
    AVX-512) replaces `-march=native`, so tests can build another CPU's vector path."""
    march = os.environ.get("PDSERVE_KERNEL_MARCH")
    base = [f"-march={march}" if f == "-march=native" and march else f for f in CXXFLAGS]
    return [*base, *EXTRA_FLAGS.get(name, [])]


def library_path(name: str, cxx: str) -> Path:
    h = hashlib.sha256((CSRC / f"{name}.cpp").read_bytes())
    for header in sorted(CSRC.glob("*.h")):  # included by the sources
        h.update(header.read_bytes())
    for part in (" ".join(flags(name)), _compiler_version(cxx), _cpu_flags()):
        h.update(part.encode())
    return cache_dir() / f"{name}-{h.hexdigest()[:16]}.so"


def build(name: str) -> Path:
    """The shared library for kernels/csrc/<name>.cpp, compiled now unless cached.

    Raises RuntimeError naming the reason (no compiler, compiler error, timeout).
    """
    cxx = find_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    path = library_path(name, cxx)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    t0 = time.perf_counter()
    try:
        cmd = [cxx, *flags(name), str(CSRC / f"{name}.cpp"), "-o", tmp]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"compiling {name} took over {BUILD_TIMEOUT_S:.0f} s") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built CPU kernel %s in %.1f s: %s", name, time.perf_counter() - t0, path)
    return path


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """The loaded kernel library, or None (reason logged once) if it cannot be built."""
    try:
        return ctypes.CDLL(str(build(name)))
    except Exception as e:  # any failure to locate, build or load: serve the reference
        logger.warning("CPU kernel %s unavailable, using the pure-torch reference: %s", name, e)
        return None

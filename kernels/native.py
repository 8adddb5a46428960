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

`SIGNATURES` declares every C++ entry point once, by library and name, with its argument
names and ctypes types as the C++ declares them; `load_library` applies them, so a wrapper
calls `load_library("gemv").pdserve_gemv(...)` with nothing of its own to set up.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first: the kernels share its thread pool)

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
# tests only: the packed GEMM's AMX path on tiles in software (kernels/csrc/amx_emulate.h)
AMX_EMULATE_ENV = "PDSERVE_KERNEL_AMX_EMULATE"
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


def _cpuinfo_line(prefixes: tuple[str, ...]) -> str | None:
    """The first /proc/cpuinfo line starting with one of `prefixes`, or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(prefixes):
                    return line
    except OSError:
        pass
    return None


def _cpu_flags() -> str:
    line = _cpuinfo_line(("flags", "Features"))
    if line is not None:
        return line
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
    AVX-512) replaces `-march=native`, so tests can build another CPU's vector path, and
    `$PDSERVE_KERNEL_AMX_EMULATE` builds the packed GEMM's AMX path on tiles in software
    (an AVX-512 bf16 CPU without AMX). The GEMV prefetches bf16 weights non-temporally on
    AMD only (kernels/csrc/gemv.cpp)."""
    march = os.environ.get("PDSERVE_KERNEL_MARCH")
    base = [f"-march={march}" if f == "-march=native" and march else f for f in CXXFLAGS]
    if name == "gemv" and _cpu_vendor() == "AuthenticAMD":
        base.append("-DPDSERVE_BF16_PREFETCH_NTA=1")
    if name == "gemm_packed" and os.environ.get(AMX_EMULATE_ENV):
        base.append("-DPDSERVE_AMX_EMULATE=1")  # tests only: csrc/amx_emulate.h
    return [*base, *EXTRA_FLAGS.get(name, [])]


def _cpu_vendor() -> str:
    line = _cpuinfo_line(("vendor_id",))
    return "" if line is None else line.partition(":")[2].strip()


def library_path(name: str, cxx: str) -> Path:
    h = hashlib.sha256((CSRC / f"{name}.cpp").read_bytes())
    for header in sorted(CSRC.glob("*.h")):  # included by the sources
        h.update(header.read_bytes())
    for part in (" ".join(flags(name)), _compiler_version(cxx), _cpu_flags()):
        h.update(part.encode())
    return cache_dir() / f"{name}-{h.hexdigest()[:16]}.so"


def check_owned(path: Path) -> None:
    """Raise RuntimeError unless `path` and its folder belong to this user and only this
    user can write them: the cache path is predictable, and a library planted there by
    someone else would run as us."""
    for p in (path, path.parent):
        st = os.lstat(p)
        if p is path and not stat.S_ISREG(st.st_mode):
            raise RuntimeError(f"{p} is not a regular file: not loaded")
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise RuntimeError(
                f"{p} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: "
                "only a file (and folder) of this user that no one else can write is loaded"
            )


def build(name: str) -> Path:
    """The shared library for kernels/csrc/<name>.cpp, compiled now unless cached.

    Raises RuntimeError naming the reason (no compiler, compiler error, timeout).
    """
    cxx = find_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    path = library_path(name, cxx)
    if path.exists():
        check_owned(path)
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
    """The loaded kernel library with its `SIGNATURES` applied, or None (reason logged
    once) if it cannot be built."""
    try:
        return bind(ctypes.CDLL(str(build(name))), name)
    except Exception as e:  # any failure to locate, build or load: serve the reference
        logger.warning("CPU kernel %s unavailable, using the pure-torch reference: %s", name, e)
        return None


def bind(lib: ctypes.CDLL, name: str) -> ctypes.CDLL:
    """`lib` (a build of kernels/csrc/<name>.cpp) with its `SIGNATURES` applied."""
    for fn_name, (restype, args) in SIGNATURES[name].items():
        fn = getattr(lib, fn_name)
        fn.restype, fn.argtypes = restype, [t for _, t in args]
    return lib


def address(lib: ctypes.CDLL, fn_name: str) -> int:
    """The address of `fn_name` in `lib` (decode_forward.cpp calls the other libraries'
    kernels through such addresses)."""
    return ctypes.cast(getattr(lib, fn_name), ctypes.c_void_p).value


# The C++ entry points, per library (kernels/csrc/<library>.cpp): {name: (return type,
# ((argument, type), ...))}, argument names as in the C++. `ptr` is any pointer (tensor
# data, a struct); `dtype` arguments are 0 = float32, 1 = bfloat16.
ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _args(spec: str) -> tuple[tuple[str, type], ...]:
    """`"x: ptr, n: i64"` -> (("x", c_void_p), ("n", c_int64))."""
    types = {"ptr": ptr, "i64": i64, "i32": i32, "f32": f32}
    pairs = (a.split(":") for a in spec.split(",") if a.strip())
    return tuple((n.strip(), types[t.strip()]) for n, t in pairs)


_GEMM_PACKED = (
    "x: ptr, xs: i64, wp: ptr, n: i64, k: i64, silu: i32, bias: ptr, res: ptr, rs: i64,"
    "y: ptr, ys: i64, m: i64"
)
_GEMM_LOGITS = "x: ptr, xs: i64, wp: ptr, n: i64, k: i64, y: ptr, ys: i64, m: i64, threads: i32"
_DECODE_STEP = (
    "ids: ptr, positions: ptr, slots: ptr, tables: ptr, width: i64, lens: ptr, m: i64,"
    "out: ptr, threads: i32"
)
SIGNATURES: dict[str, dict[str, tuple[type, tuple[tuple[str, type], ...]]]] = {
    "argmax": {
        "pdserve_argmax_rows": (i32, _args("x: ptr, row_stride: i64, rows: i64, n: i64, out: ptr")),
    },
    "elementwise": {
        "pdserve_rms_norm": (i32, _args(
            "x: ptr, xs: i64, res: ptr, rs: i64, w: ptr, out: ptr, os: i64, res_out: ptr,"
            "ros: i64, rows: i64, n: i64, eps: f32, dtype: i32, threads: i32")),
        "pdserve_silu_and_mul": (i32, _args(
            "x: ptr, xs: i64, out: ptr, os: i64, rows: i64, n: i64, dtype: i32, threads: i32")),
        "pdserve_rope": (i32, _args(
            "positions: ptr, q: ptr, qs_t: i64, qs_h: i64, hq: i64, k: ptr, ks_t: i64, ks_h: i64,"
            "hk: i64, cos_sin: ptr, d: i64, tokens: i64, dtype: i32, threads: i32")),
        "pdserve_store_kv": (i32, _args(
            "k: ptr, ks_t: i64, v: ptr, vs_t: i64, k_cache: ptr, v_cache: ptr, slots: ptr,"
            "tokens: i64, row_bytes: i64, block_size: i64, block_bytes: i64, num_slots: i64,"
            "threads: i32")),
    },
    "gemv": {
        "pdserve_gemv": (i32, _args(
            "x: ptr, xs: i64, w: ptr, ws: i64, b: ptr, y: ptr, ys: i64, m: i64, n: i64, k: i64,"
            "dtype: i32, threads: i32, silu: i32")),
        "pdserve_norm_gemv": (i32, _args(
            "x: ptr, xs: i64, res: ptr, rs: i64, nw: ptr, eps: f32, res_out: ptr, ros: i64,"
            "w: ptr, ws: i64, b: ptr, y: ptr, ys: i64, m: i64, n: i64, k: i64, dtype: i32,"
            "threads: i32, silu: i32")),
        "pdserve_gemv_isa": (i32, ()),
    },
    "gemm_packed": {
        "pdserve_packed_floats": (i64, _args("n: i64, k: i64, silu: i32")),
        "pdserve_packed_bf16_elems": (i64, _args("n: i64, k: i64, silu: i32")),
        "pdserve_pack": (i32, _args(
            "w: ptr, ws: i64, n: i64, k: i64, silu: i32, out: ptr, threads: i32")),
        "pdserve_pack_bf16": (i32, _args(
            "w: ptr, ws: i64, n: i64, k: i64, silu: i32, out: ptr, threads: i32")),
        "pdserve_gemm_packed": (i32, _args(_GEMM_PACKED + ", threads: i32")),
        "pdserve_gemm_packed_bf16": (i32, _args(_GEMM_PACKED + ", y_f32: i32, threads: i32")),
        "pdserve_gemm_packed_logits": (i32, _args(_GEMM_LOGITS)),
        "pdserve_gemm_packed_bf16_logits": (i32, _args(_GEMM_LOGITS)),
        "pdserve_gemm_packed_team": (i32, _args(_GEMM_PACKED)),
        "pdserve_gemm_packed_bf16_team": (i32, _args(_GEMM_PACKED)),
        "pdserve_gemm_packed_isa": (i32, ()),
        "pdserve_gemm_packed_bf16_native": (i32, ()),
        "pdserve_gemm_packed_bf16_amx": (i32, _args("k: i64")),
    },
    "paged_decode": {
        "pdserve_paged_decode_head_dim_ok": (i32, _args("head_dim: i64")),
        "pdserve_paged_decode": (i32, _args(
            "q: ptr, k_cache: ptr, v_cache: ptr, block_tables: ptr, context_lens: ptr, out: ptr,"
            "num_seqs: i64, num_heads: i64, num_kv_heads: i64, head_dim: i64, block_size: i64,"
            "max_blocks: i64, q_stride_seq: i64, q_stride_head: i64, block_stride: i64,"
            "split_keys: i64, num_splits: i64, scale: f32, dtype: i32, num_threads: i32")),
    },
    "prefill_attention": {
        "pdserve_prefill_attention": (i32, _args(
            "q: ptr, qs_t: i64, qs_h: i64, k: ptr, ks_t: i64, ks_h: i64, v: ptr, vs_t: i64,"
            "vs_h: i64, out: ptr, begins: ptr, ends: ptr, kv_begins: ptr, q_offsets: ptr,"
            "nseq: i64, h: i64, hkv: i64, d: i64, scale: f32, dtype: i32, threads: i32")),
    },
    "decode_forward": {  # model: a decode_forward.Model (PdserveModel), by address
        "pdserve_decode_forward": (i32, _args("model: ptr, " + _DECODE_STEP)),
        "pdserve_decode_forward_batch": (i32, _args("model: ptr, " + _DECODE_STEP)),
        "pdserve_decode_attention": (i32, _args(
            "model: ptr, layer: i64, qkv: ptr, positions: ptr, slots: ptr, tables: ptr,"
            "width: i64, lens: ptr, m: i64, out: ptr, threads: i32")),
    },
}  # fmt: skip

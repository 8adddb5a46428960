"""Small-M linear on CPU for decode steps (kernels/csrc/gemv.cpp): y = x W^T (+ b).

A decode step of a few sequences reads every projection's whole weight for a few rows of
activations: memory-bound. The kernel streams the weight in its plain [out, in] layout
(no packed copy) with all rows of x sharing each weight load, output rows split over
the OpenMP threads in one parallel region per call. Contract: `F.linear` with fp32
accumulation (fp32 and bf16; in bf16 the result is rounded once, at the end).

Only steps of generated tokens call it (the runner's step plan, engine/step_plan.py): a step
with prompt tokens in it runs the prepacked GEMM at any row count, so a prompt's rows get
the same bits whether its prefix was cached or not (the GEMV sums in another order than
oneDNN; the same request twice would otherwise give different logprobs).

`linear` returns None for what the kernel does not take (more than `MAX_ROWS` rows, a
dtype other than fp32/bf16 or mixed dtypes, a non-CPU tensor, an inner dimension that
is not contiguous, inside a torch.compile trace) and on a machine where the library
cannot be built: the caller then runs its own GEMM.
"""

from __future__ import annotations

import torch

from pdserve.kernels import native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Above this many rows the prepacked oneDNN GEMM is faster (docs/benchmarks-history.md,
# "Decode GEMV").
MAX_ROWS = 8

_threads = torch.get_num_threads


def available() -> bool:
    """Whether the native library is built and loaded on this machine."""
    return native.load_library("gemv") is not None


def isa() -> int:
    """The build's vector width in bits (512, 256, 32), +1 with the avx512_bf16 dot."""
    lib = native.load_library("gemv")
    return -1 if lib is None else int(lib.pdserve_gemv_isa())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N], or None (not taken here)."""
    if x.dim() != 2:  # [..., K]: as [rows, K]
        if x.dim() < 2:
            return None
        y = linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return None if y is None else y.view(*x.shape[:-1], weight.shape[0])
    return _call(x, weight, bias, 0)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """silu(x gate^T) * (x up^T) -> [T, I] for x [T, K] and weight [2 I, K] (gate rows, then
    up rows): `reference.silu_and_mul(F.linear(x, weight))` in one call, rounded where that
    rounds; or None (not taken here)."""
    if torch.compiler.is_compiling() or x.dim() != 2 or weight.dim() != 2 or weight.shape[0] % 2:
        return None
    return _call(x, weight, None, 1)


def norm_linear(
    x: torch.Tensor,  # [T, K]
    residual: torch.Tensor | None,  # [T, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K], or [2 I, K] gate | up rows with silu
    bias: torch.Tensor | None,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decoder layer's (residual add +) RMSNorm and the projection after it in one call:
    `h, res = fused_add_rms_norm(x, residual, norm_weight, eps)` (`rms_norm` and res = x when
    residual is None), then `linear(h, weight, bias)` (or `gate_up_silu(h, weight)`);
    returns (projection, res), or None (not taken here)."""
    if torch.compiler.is_compiling() or x.dim() != 2 or weight.dim() != 2:
        return None
    m, k = x.shape
    dtype = x.dtype
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != dtype or residual.stride(1) != 1
    ):
        return None
    if norm_weight.dtype != dtype or norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        return None
    if (silu and (bias is not None or weight.shape[0] % 2)) or not norm_weight.is_cpu:
        return None
    if _call(x, weight, bias, int(silu), check_only=True) is None:
        return None
    n = weight.shape[0] >> int(silu)
    y = torch.empty((m, n), dtype=dtype)
    res_out = x if residual is None else torch.empty((m, k), dtype=dtype)
    native.load_library("gemv").pdserve_norm_gemv(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), norm_weight.data_ptr(), eps,
        res_out.data_ptr(), k, weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k, _DTYPES[dtype],
        _threads(), int(silu),
    )  # fmt: skip
    return y, res_out


def _call(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: int,
    check_only: bool = False,
) -> torch.Tensor | bool | None:
    # one call per projection per decode step: the checks are ordered cheap and common first
    m, k = x.shape
    dtype = x.dtype
    code = _DTYPES.get(dtype)
    if code is None or m > MAX_ROWS or m == 0 or weight.dtype != dtype or weight.dim() != 2:
        return None
    n, wk = weight.shape
    ws, wstep = weight.stride()
    xs, xstep = x.stride()
    if wk != k or wstep != 1 or xstep != 1 or not x.is_cpu or not weight.is_cpu:
        return None
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous() or bias.shape != (n,)):
        return None
    lib = native.load_library("gemv")
    if lib is None or torch.compiler.is_compiling():
        return None
    if check_only:
        return True
    n >>= silu  # gate_up: half the rows are outputs
    y = torch.empty((m, n), dtype=dtype)
    b = None if bias is None else bias.data_ptr()
    lib.pdserve_gemv(
        x.data_ptr(), xs, weight.data_ptr(), ws, b, y.data_ptr(), n, m, n, k, code, _threads(), silu
    )
    return y

"""A whole decode forward in one native call on CPU (kernels/csrc/decode_forward.cpp).

For decode steps of up to `gemv.MAX_ROWS` (`kernels.ops.GEMV_MAX_ROWS`) rows, the Llama model's per-op path crosses
from Python to native code ~10 times a layer, with nn.Module calls, views and wrapper
checks around each crossing, all of it serial with the weight streaming (a large share of
a one-row token at SmolLM2's size). `decode_forward` runs the same kernels (the ones
kernels/gemv.py, elementwise.py and paged_decode.py call) chained in C++, with the
arguments those wrappers would pass, so its hidden states equal the per-op path's bit for
bit. The model is described once (`DecodePlan`: weight, norm and cache pointers, the
kernels' addresses); a step passes only its inputs.

The plan holds raw pointers: it is valid while the model's weights and the KV cache it was
built for are alive and not moved (engine/models/fused_decode.py keeps both referenced).
`libraries()` is None where any of the four libraries cannot be built: the caller then
runs the per-op path.
"""

from __future__ import annotations

import ctypes

from pdserve.kernels import elementwise, native, paged_decode

_p, _i64, _f32, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32


class Layer(ctypes.Structure):
    """`PdserveLayer`: one decoder layer's weights and K/V cache planes."""

    _fields_ = [
        ("input_norm", _p), ("qkv", _p), ("qkv_ws", _i64), ("qkv_bias", _p),
        ("o", _p), ("o_ws", _i64), ("post_norm", _p), ("gate_up", _p), ("gate_up_ws", _i64),
        ("down", _p), ("down_ws", _i64), ("k_cache", _p), ("v_cache", _p),
        ("qkv_p", _p), ("o_p", _p), ("gate_up_p", _p), ("down_p", _p),
    ]  # fmt: skip


class Model(ctypes.Structure):
    """`PdserveModel`: the chained kernels, the model's shapes and weights, the cache."""

    _fields_ = [
        ("norm_gemv", _p), ("gemv", _p), ("rms_norm", _p), ("rope", _p), ("store_kv", _p),
        ("paged_decode", _p),
        ("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
        ("head_dim", _i64), ("intermediate", _i64), ("vocab", _i64),
        ("eps", _f32), ("scale", _f32), ("dtype", _i32),
        ("embed", _p), ("embed_stride", _i64), ("final_norm", _p),
        ("cos_sin", _p), ("max_pos", _i64),
        ("block_size", _i64), ("block_stride", _i64), ("num_blocks", _i64),
        ("parallel_min_elements", _i64), ("items_per_thread", _i64), ("min_split_keys", _i64),
        ("layers", ctypes.POINTER(Layer)), ("gemm_packed_team", _p), ("silu_mode", _i32),
    ]  # fmt: skip


ERRORS = {
    1: "a token id outside the vocabulary",
    2: "a position outside the RoPE table",
    3: "a KV slot outside the cache",
    4: "a context length outside the block table",
    5: "a kernel refused its arguments",
    6: "no packed weights for the batched forward",
}


def libraries() -> tuple[ctypes.CDLL, dict[str, int]] | None:
    """(the decode_forward library, {kernel field of `Model`: address}), or None if any of
    the libraries cannot be built here. Its entry points (kernels/native.py SIGNATURES) take
    the `Model` by address: `pdserve_decode_forward` (a whole decode step),
    `pdserve_decode_forward_batch` (the same on packed weights, kernels/gemm_packed.py) and
    `pdserve_decode_attention` (one layer's RoPE + KV store + paged decode attention, for
    steps whose GEMMs stay in Python)."""
    names = ("decode_forward", "gemv", "elementwise", "paged_decode")
    libs = {n: native.load_library(n) for n in names}
    if any(lib is None for lib in libs.values()):
        return None
    kernels = {
        "norm_gemv": native.address(libs["gemv"], "pdserve_norm_gemv"),
        "gemv": native.address(libs["gemv"], "pdserve_gemv"),
        "rms_norm": native.address(libs["elementwise"], "pdserve_rms_norm"),
        "rope": native.address(libs["elementwise"], "pdserve_rope"),
        "store_kv": native.address(libs["elementwise"], "pdserve_store_kv"),
        "paged_decode": native.address(libs["paged_decode"], "pdserve_paged_decode"),
    }
    return libs["decode_forward"], kernels


def wrapper_constants() -> dict[str, int]:
    """The Python wrappers' thresholds the native chain must apply the same way."""
    return {
        "parallel_min_elements": elementwise.PARALLEL_MIN_ELEMENTS,
        "items_per_thread": paged_decode.ITEMS_PER_THREAD,
        "min_split_keys": paged_decode.MIN_SPLIT_KEYS,
    }

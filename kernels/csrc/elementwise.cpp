// Fused elementwise ops of a decoder layer on CPU: RMSNorm (with the residual add),
// rotary embedding (in place), SiLU(gate) * up, and the KV cache store.
//
// Contracts: kernels/reference.py (rms_norm, fused_add_rms_norm, rotary_embedding,
// silu_and_mul, store_kv). Each is one call doing what the reference does in 4-26 torch
// ops: in eager mode every torch op costs a few microseconds of dispatch, which is most
// of a one-row decode step's non-GEMM time. Storage fp32 or bf16, arithmetic fp32; in
// bf16 the result is rounded where the reference's torch ops round (after each op that
// yields a bf16 tensor), so both agree to the last bit but for summation order.
// Built with -ffp-contract=off (kernels/native.py): a*b - c*d is not fused into an FMA,
// as torch's separate ops do not fuse it.
//
// Rows are split over OpenMP threads only when a call has enough work to pay for the
// fork/join (`threads` is 1 below that; the caller decides).

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "exp_approx.h"

namespace {

using pdserve_cpu::bf16_to_float;
using pdserve_cpu::float_to_bf16;
using pdserve_cpu::load;
using pdserve_cpu::store;
// The value a torch op on T tensors would hold: identity in fp32, rounded in bf16.
inline float round_to(float x, const float*) { return x; }
inline float round_to(float x, const uint16_t*) { return bf16_to_float(float_to_bf16(x)); }

using pdserve_cpu::exp_approx;  // exp_approx.h

// out = w * norm(x + res); res_out = x + res (res may be null: no add, res_out unused).
template <typename T>
void rms_norm(const T* x, int64_t xs, const T* res, int64_t rs, const T* w, T* out, int64_t os,
              T* res_out, int64_t ros, int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> buf(n);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * xs;
      float ss = 0.0f;
      if (res != nullptr) {
        const T* rr = res + r * rs;
        T* ro = res_out + r * ros;
        for (int64_t i = 0; i < n; ++i) {
          const float v = round_to(load(xr + i) + load(rr + i), xr);
          store(ro + i, v);
          buf[i] = v;
        }
      } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = load(xr + i);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += buf[i] * buf[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* orow = out + r * os;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) store(orow + i, load(w + i) * round_to(buf[i] * inv, xr));
    }
  }
}

#if defined(__AVX512BF16__)
// rms_norm<uint16_t> on 16 lanes with the same roundings (bf16.h float_to_bf16_v: the
// same bits as float_to_bf16); GCC's code for the loops above spends most of a bf16
// row's time narrowing and rounding in 8-lane steps. Sums of squares in 16 lanes (the
// order differs, as between any two summations; mul then add, never fused).
void rms_norm_bf16(const uint16_t* x, int64_t xs, const uint16_t* res, int64_t rs,
                   const uint16_t* w, uint16_t* out, int64_t os, uint16_t* res_out, int64_t ros,
                   int64_t rows, int64_t n, float eps, int threads) {
  using namespace pdserve_cpu;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> buf(n + 16);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* xr = x + r * xs;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        __m512 v = load_bf16_v(m, xr + i);
        if (res != nullptr) {
          const __m256i h = float_to_bf16_v(_mm512_add_ps(v, load_bf16_v(m, res + r * rs + i)));
          _mm256_mask_storeu_epi16(res_out + r * ros + i, m, h);
          v = bf16_to_float_v(h);
        }
        _mm512_storeu_ps(buf.data() + i, v);
        ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));  // lanes past n: zero
      }
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps);
      const __m512 vinv = _mm512_set1_ps(inv);
      uint16_t* orow = out + r * os;
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes(n - i);
        const __m512 y = round_bf16_v(_mm512_mul_ps(_mm512_loadu_ps(buf.data() + i), vinv));
        _mm256_mask_storeu_epi16(orow + i, m, float_to_bf16_v(_mm512_mul_ps(load_bf16_v(m, w + i), y)));
      }
    }
  }
}
#endif

// out[r, i] = silu(x[r, i]) * x[r, n + i]; silu(g) = g / (1 + exp(-g)).
template <typename T>
void silu_and_mul(const T* x, int64_t xs, T* out, int64_t os, int64_t rows, int64_t n,
                  int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = x + r * xs;
    const T* u = g + n;
    T* o = out + r * os;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float gv = load(g + i);
      const float s = round_to(gv / (1.0f + exp_approx(-gv)), g);
      store(o + i, s * load(u + i));
    }
  }
}

// NeoX rotary embedding of `heads` heads of one token, in place: the two halves of D.
template <typename T>
inline void rotate(T* x, int64_t heads, int64_t head_stride, const float* cs, int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * head_stride;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float c = round_to(cs[i], xh), s = round_to(cs[half + i], xh);
      const float x1 = load(xh + i), x2 = load(xh + half + i);
      const float a = round_to(x1 * c, xh), b = round_to(x2 * s, xh);
      const float e = round_to(x2 * c, xh), f = round_to(x1 * s, xh);
      store(xh + i, a - b);
      store(xh + half + i, e + f);
    }
  }
}

#if defined(__AVX512BF16__)
// rotate<uint16_t> on 16 lanes, the same roundings (see rms_norm_bf16).
inline void rotate(uint16_t* x, int64_t heads, int64_t head_stride, const float* cs, int64_t half) {
  using namespace pdserve_cpu;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = lanes(half - i);
    const __m512 c = round_bf16_v(_mm512_maskz_loadu_ps(m, cs + i));
    const __m512 s = round_bf16_v(_mm512_maskz_loadu_ps(m, cs + half + i));
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* xh = x + h * head_stride;
      const __m512 x1 = load_bf16_v(m, xh + i), x2 = load_bf16_v(m, xh + half + i);
      const __m512 a = round_bf16_v(_mm512_mul_ps(x1, c)), b = round_bf16_v(_mm512_mul_ps(x2, s));
      const __m512 e = round_bf16_v(_mm512_mul_ps(x2, c)), f = round_bf16_v(_mm512_mul_ps(x1, s));
      _mm256_mask_storeu_epi16(xh + i, m, float_to_bf16_v(_mm512_sub_ps(a, b)));
      _mm256_mask_storeu_epi16(xh + half + i, m, float_to_bf16_v(_mm512_add_ps(e, f)));
    }
  }
}
#endif

template <typename T>
void rope(const int64_t* positions, T* q, int64_t qs_t, int64_t qs_h, int64_t hq, T* k,
          int64_t ks_t, int64_t ks_h, int64_t hk, const float* cos_sin, int64_t d,
          int64_t tokens, int threads) {
  const int64_t half = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cs = cos_sin + positions[t] * d;
    rotate(q + t * qs_t, hq, qs_h, cs, half);
    rotate(k + t * ks_t, hk, ks_h, cs, half);
  }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. Strides in elements; the last dim is contiguous.
// res == null: plain RMSNorm. Returns 0, or -1 on an unsupported dtype.
int pdserve_rms_norm(const void* x, int64_t xs, const void* res, int64_t rs, const void* w,
                     void* out, int64_t os, void* res_out, int64_t ros, int64_t rows, int64_t n,
                     float eps, int dtype, int threads) {
  if (dtype == 0) {
    rms_norm(static_cast<const float*>(x), xs, static_cast<const float*>(res), rs,
             static_cast<const float*>(w), static_cast<float*>(out), os,
             static_cast<float*>(res_out), ros, rows, n, eps, threads);
  } else if (dtype == 1) {
#if defined(__AVX512BF16__)
    rms_norm_bf16(static_cast<const uint16_t*>(x), xs, static_cast<const uint16_t*>(res), rs,
                  static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), os,
                  static_cast<uint16_t*>(res_out), ros, rows, n, eps, threads);
    return 0;
#endif
    rms_norm(static_cast<const uint16_t*>(x), xs, static_cast<const uint16_t*>(res), rs,
             static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), os,
             static_cast<uint16_t*>(res_out), ros, rows, n, eps, threads);
  } else {
    return -1;
  }
  return 0;
}

int pdserve_silu_and_mul(const void* x, int64_t xs, void* out, int64_t os, int64_t rows,
                         int64_t n, int dtype, int threads) {
  if (dtype == 0) {
    silu_and_mul(static_cast<const float*>(x), xs, static_cast<float*>(out), os, rows, n,
                 threads);
  } else if (dtype == 1) {
    silu_and_mul(static_cast<const uint16_t*>(x), xs, static_cast<uint16_t*>(out), os, rows, n,
                 threads);
  } else {
    return -1;
  }
  return 0;
}

// q [T, Hq, D] and k [T, Hk, D] rotated in place; cos_sin [max_pos, D] fp32.
int pdserve_rope(const int64_t* positions, void* q, int64_t qs_t, int64_t qs_h, int64_t hq,
                 void* k, int64_t ks_t, int64_t ks_h, int64_t hk, const float* cos_sin,
                 int64_t d, int64_t tokens, int dtype, int threads) {
  if (d % 2) return -1;
  if (dtype == 0) {
    rope(positions, static_cast<float*>(q), qs_t, qs_h, hq, static_cast<float*>(k), ks_t, ks_h,
         hk, cos_sin, d, tokens, threads);
  } else if (dtype == 1) {
    rope(positions, static_cast<uint16_t*>(q), qs_t, qs_h, hq, static_cast<uint16_t*>(k), ks_t,
         ks_h, hk, cos_sin, d, tokens, threads);
  } else {
    return -1;
  }
  return 0;
}

// Token t's `row_bytes` of K and of V (its kv heads, contiguous) copied to slot
// slots[t] = block * block_size + offset of the caches: byte offset block * block_bytes
// (the stride between blocks, which may exceed a block: a block-major cache's layer view)
// + offset * row_bytes. A slot < 0 is skipped. Returns -1 (nothing written) if a slot is
// >= num_slots.
int pdserve_store_kv(const char* k, int64_t ks_t, const char* v, int64_t vs_t, char* k_cache,
                     char* v_cache, const int64_t* slots, int64_t tokens, int64_t row_bytes,
                     int64_t block_size, int64_t block_bytes, int64_t num_slots, int threads) {
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= num_slots) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    const int64_t at = (s / block_size) * block_bytes + (s % block_size) * row_bytes;
    std::memcpy(k_cache + at, k + t * ks_t, row_bytes);
    std::memcpy(v_cache + at, v + t * vs_t, row_bytes);
  }
  return 0;
}

}  // extern "C"

// Small-M GEMM for decode on CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]), M small.
//
// Contract: torch.nn.functional.linear(x, w, b) with x [M, K], w [N, K] in its plain
// row-major layout (rows `ws` elements apart, inner dim contiguous), y [M, N]; x, w, b and
// y all fp32 or all bf16; arithmetic fp32 (bf16 products are exact in fp32, so both bf16
// paths below differ from an fp32 reference only by summation order), y rounded to bf16
// to nearest even. A decode step of one sequence reads every weight once per token: the
// GEMV is bound by how fast the weights stream from DRAM, so the kernel streams each
// output row's contiguous K (no repacked copy) with 16/8/4 rows in flight per register
// block (for 1/2/3+ activation rows) and each row prefetched ahead of its use,
// all M activation rows sharing each weight load (activation rows in chunks of MB; a
// chunk after the first reads the block's weights from L1/L2, not DRAM).
//
// Vector paths, chosen at compile time (-march, kernels/native.py): AVX-512 (16 floats a
// load; bf16 weights through avx512_bf16's dot product when the CPU has it, else widened
// to fp32), AVX2 + FMA (8 floats), plain C++ otherwise. Output rows are split statically
// over OpenMP threads in contiguous ranges of whole register blocks, one parallel region
// per call. Called through ctypes (kernels/gemv.py): no torch headers.

#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16.h"

namespace {

using pdserve_cpu::load;
using pdserve_cpu::store;

constexpr int MB = 4;     // activation rows per register block (more: in chunks of MB)
constexpr int RMAX = 16;  // weight rows per register block: 16 / 8 / 4 for 1 / 2 / 3+ rows
// Each weight row is prefetched this many rows ahead of its use: a 1-row GEMV over
// DRAM-resident weights streams faster with it; prefetching into L1 or non-temporal gained
// nothing for the GEMV alone. fp32 rows go into L2 (prefetcht1). On AMD Zen
// (PDSERVE_BF16_PREFETCH_NTA, set by kernels/native.py) bf16 rows are prefetched
// non-temporal (prefetchnta): the weights then do not evict the last-level cache's other
// data (the KV rows attention reads next, the engine's Python between steps), which made
// a bf16 single-row token ~5 % faster there; fp32 gained nothing from it, so it keeps
// prefetcht1 (figures: docs/benchmarks-history.md, "Decode GEMV" and "Decode forward in
// fewer native calls"). On an Intel Xeon with AMX the same hint made a bf16 GEMV over a
// DRAM-resident weight 4-6x slower (4.6-7.6 GB/s against 27 GB/s at one thread: the lines
// seem to leave L1 before their use), so everywhere else bf16 rows go into L2 as fp32's do.
template <typename T>
constexpr int64_t PF_ROWS = 64 / sizeof(T);  // 16 fp32 rows, 32 bf16 rows
#ifndef PDSERVE_BF16_PREFETCH_NTA
#define PDSERVE_BF16_PREFETCH_NTA 0
#endif
template <typename T>
inline void prefetch(const T* p) {
  if constexpr (PDSERVE_BF16_PREFETCH_NTA && sizeof(T) == 2) {
    __builtin_prefetch(p, 0, 0);  // x86: prefetchnta
  } else {
    __builtin_prefetch(p, 0, 2);  // x86: prefetcht1
  }
}

#if defined(__AVX512F__)
constexpr int V = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const uint16_t* p) {  // 16 bf16 -> 16 fp32 (exact: bf16 is fp32's top half)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int V = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int V = 1;
using vf = float;
inline vf vzero() { return 0.0f; }
inline vf vload(const float* p) { return *p; }
inline vf vload(const uint16_t* p) { return load(p); }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline float vsum(vf a) { return a; }
#endif

// out[m][r] = dot(x row m, w row r) over k, for M activation rows and RR weight rows.
template <typename T, int M, int RR>
inline void dot_block(const T* x, int64_t xs, const T* w, int64_t ws, int64_t k,
                      float (&out)[MB][RMAX]) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  if constexpr (sizeof(T) == 2) {  // bf16: 32 products a dpbf16ps, fp32 accumulate
    __m512 acc[M][RR];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < RR; ++r) acc[m][r] = _mm512_setzero_ps();
    for (; i < k; i += 32) {
      const __mmask32 mask = k - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - i)) - 1;
      __m512bh wv[RR];
      for (int r = 0; r < RR; ++r) {
        wv[r] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, w + r * ws + i));
        prefetch(w + r * ws + i + PF_ROWS<T> * ws);
      }
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, x + m * xs + i));
        for (int r = 0; r < RR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < RR; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
    return;
  }
#endif
  vf acc[M][RR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) acc[m][r] = vzero();
  for (; i + V <= k; i += V) {
    vf wv[RR];
    for (int r = 0; r < RR; ++r) {
      wv[r] = vload(w + r * ws + i);
      prefetch(w + r * ws + i + PF_ROWS<T> * ws);
    }
    for (int m = 0; m < M; ++m) {
      const vf xv = vload(x + m * xs + i);
      for (int r = 0; r < RR; ++r) acc[m][r] = vfma(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) {
      float s = vsum(acc[m][r]);
      for (int64_t j = i; j < k; ++j) s += load(x + m * xs + j) * load(w + r * ws + j);
      out[m][r] = s;
    }
}

template <typename T, int RR>
inline void dot_rows(const T* x, int64_t xs, const T* w, int64_t ws, int64_t k, int64_t mb,
                     float (&out)[MB][RMAX]) {
  switch (mb) {
    case 1: dot_block<T, 1, RR>(x, xs, w, ws, k, out); break;
    case 2: dot_block<T, 2, (RR < 8 ? RR : 8)>(x, xs, w, ws, k, out); break;
    case 3: dot_block<T, 3, (RR < 4 ? RR : 4)>(x, xs, w, ws, k, out); break;
    default: dot_block<T, 4, (RR < 4 ? RR : 4)>(x, xs, w, ws, k, out); break;
  }
}

// The value a torch op on T tensors would hold: identity in fp32, rounded in bf16.
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const uint16_t*) {
  return pdserve_cpu::bf16_to_float(pdserve_cpu::float_to_bf16(v));
}

// Output rows [n0, n1) for every activation row, RB weight rows at a time. silu: w is
// [2 N, K] (gate rows, then up rows), y[m, j] = silu(gate_j) * up_j, rounded where the
// unfused F.linear -> silu -> mul would round (kernels/reference.py silu_and_mul).
template <typename T, int RB>
void gemv_rows(const T* x, int64_t xs, const T* w, int64_t ws, const T* b, T* y, int64_t ys,
               int64_t m, int64_t n, int64_t k, int64_t n0, int64_t n1, bool silu) {
  float out[MB][RMAX], up[MB][RMAX];
  for (int64_t j0 = n0; j0 < n1; j0 += RB) {
    const int64_t rr = std::min<int64_t>(RB, n1 - j0);
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
      const int64_t mb = std::min<int64_t>(MB, m - m0);
      const T* xm = x + m0 * xs;
      for (int part = 0; part < (silu ? 2 : 1); ++part) {
        const T* wb = w + (j0 + part * n) * ws;
        float(&dst)[MB][RMAX] = part == 0 ? out : up;
        if (rr == RB) {
          dot_rows<T, RB>(xm, xs, wb, ws, k, mb, dst);
        } else {  // the range's last rows: one at a time
          for (int64_t r = 0; r < rr; ++r) {
            float one[MB][RMAX];
            dot_rows<T, 1>(xm, xs, wb + r * ws, ws, k, mb, one);
            for (int64_t i = 0; i < mb; ++i) dst[i][r] = one[i][0];
          }
        }
      }
      for (int64_t i = 0; i < mb; ++i) {
        T* yr = y + (m0 + i) * ys + j0;
        for (int64_t r = 0; r < rr; ++r) {
          if (silu) {
            const float g = round_to(out[i][r], y);
            const float s = round_to(g / (1.0f + std::exp(-g)), y);
            store(yr + r, s * round_to(up[i][r], y));
          } else {
            store(yr + r, out[i][r] + (b != nullptr ? load(b + j0 + r) : 0.0f));
          }
        }
      }
    }
  }
}

template <typename T, int RB>
void gemv_split(const T* x, int64_t xs, const T* w, int64_t ws, const T* b, T* y, int64_t ys,
                int64_t m, int64_t n, int64_t k, int threads, bool silu) {
  const int64_t blocks = (n + RB - 1) / RB;
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, blocks)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t n0 = std::min(n, blocks * t / nt * RB);
    const int64_t n1 = std::min(n, blocks * (t + 1) / nt * RB);
    gemv_rows<T, RB>(x, xs, w, ws, b, y, ys, m, n, k, n0, n1, silu);
  }
}

template <typename T>
void gemv(const T* x, int64_t xs, const T* w, int64_t ws, const T* b, T* y, int64_t ys,
          int64_t m, int64_t n, int64_t k, int threads, bool silu) {
  if (m == 1) {
    gemv_split<T, 16>(x, xs, w, ws, b, y, ys, m, n, k, threads, silu);
  } else if (m == 2) {
    gemv_split<T, 8>(x, xs, w, ws, b, y, ys, m, n, k, threads, silu);
  } else {
    gemv_split<T, 4>(x, xs, w, ws, b, y, ys, m, n, k, threads, silu);
  }
}

// rows of out [m, k] = RMSNorm(x + res) * nw, res_out = x + res (res null: no add, res_out
// unused), rounded where kernels/csrc/elementwise.cpp's rms_norm rounds.
template <typename T>
void add_rms_norm(const T* x, int64_t xs, const T* res, int64_t rs, const T* nw, float eps,
                  T* res_out, int64_t ros, T* out, int64_t m, int64_t k) {
  std::vector<float> buf(k);
  for (int64_t r = 0; r < m; ++r) {
    const T* xr = x + r * xs;
    if (res != nullptr) {
      for (int64_t i = 0; i < k; ++i) {
        const float v = round_to(load(xr + i) + load(res + r * rs + i), xr);
        store(res_out + r * ros + i, v);
        buf[i] = v;
      }
    } else {
      for (int64_t i = 0; i < k; ++i) buf[i] = load(xr + i);
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < k; ++i) ss += buf[i] * buf[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(k) + eps);
    for (int64_t i = 0; i < k; ++i) store(out + r * k + i, load(nw + i) * round_to(buf[i] * inv, xr));
  }
}

template <typename T>
void norm_gemv(const T* x, int64_t xs, const T* res, int64_t rs, const T* nw, float eps,
               T* res_out, int64_t ros, const T* w, int64_t ws, const T* b, T* y, int64_t ys,
               int64_t m, int64_t n, int64_t k, int threads, bool silu) {
  std::vector<T> normed(m * k);
  add_rms_norm(x, xs, res, rs, nw, eps, res_out, ros, normed.data(), m, k);
  gemv(normed.data(), k, w, ws, b, y, ys, m, n, k, threads, silu);
}

}  // namespace

extern "C" {

// A decoder layer's norm and the projection after it in one call: y = pdserve_gemv(
// RMSNorm(x + res) * nw) and res_out = x + res (res null: plain RMSNorm, res_out unused).
int pdserve_norm_gemv(const void* x, int64_t xs, const void* res, int64_t rs, const void* nw,
                      float eps, void* res_out, int64_t ros, const void* w, int64_t ws,
                      const void* b, void* y, int64_t ys, int64_t m, int64_t n, int64_t k,
                      int dtype, int threads, int silu) {
  if (m < 0 || n < 0 || k < 0 || (silu != 0 && b != nullptr)) return 1;
  if (dtype == 0) {
    using F = float;
    norm_gemv(static_cast<const F*>(x), xs, static_cast<const F*>(res), rs,
              static_cast<const F*>(nw), eps, static_cast<F*>(res_out), ros,
              static_cast<const F*>(w), ws, static_cast<const F*>(b), static_cast<F*>(y), ys, m,
              n, k, threads, silu != 0);
  } else if (dtype == 1) {
    using H = uint16_t;
    norm_gemv(static_cast<const H*>(x), xs, static_cast<const H*>(res), rs,
              static_cast<const H*>(nw), eps, static_cast<H*>(res_out), ros,
              static_cast<const H*>(w), ws, static_cast<const H*>(b), static_cast<H*>(y), ys, m,
              n, k, threads, silu != 0);
  } else {
    return 2;
  }
  return 0;
}

// dtype: 0 fp32, 1 bf16 (x, w, b, y alike); b may be null. Strides in elements.
// silu 0: y [m, n] = x w^T + b, w [n, k]. silu 1: w [2 n, k] (gate | up rows, no bias),
// y [m, n] = silu(x gate^T) * (x up^T): a gate_up projection and its activation in one.
int pdserve_gemv(const void* x, int64_t xs, const void* w, int64_t ws, const void* b, void* y,
                 int64_t ys, int64_t m, int64_t n, int64_t k, int dtype, int threads, int silu) {
  if (m < 0 || n < 0 || k < 0 || (silu != 0 && b != nullptr)) return 1;
  if (dtype == 0) {
    gemv(static_cast<const float*>(x), xs, static_cast<const float*>(w), ws,
         static_cast<const float*>(b), static_cast<float*>(y), ys, m, n, k, threads, silu != 0);
  } else if (dtype == 1) {
    gemv(static_cast<const uint16_t*>(x), xs, static_cast<const uint16_t*>(w), ws,
         static_cast<const uint16_t*>(b), static_cast<uint16_t*>(y), ys, m, n, k, threads,
         silu != 0);
  } else {
    return 2;
  }
  return 0;
}

// Which vector path this build took: 512 (AVX-512), 256 (AVX2), 32 (scalar); +1 with the
// avx512_bf16 dot product for bf16 weights.
int pdserve_gemv_isa() {
  int bits = V * 32;
#if defined(__AVX512BF16__)
  bits += 1;
#endif
  return bits;
}

}  // extern "C"

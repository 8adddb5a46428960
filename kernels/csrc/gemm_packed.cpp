// fp32 GEMM on weights packed once into column panels, for decode steps of many rows:
// y[m, j] = sum_k x[m, k] * w[j, k] (+ b[j]) (+ res[m, j]), or for a gate_up weight
// [2 N, K] (gate rows, then up rows) y[m, j] = silu(gate_j) * up_j.
//
// Why: a decode step of 32-64 sequences is weight-streaming GEMMs (M = rows, K and N the
// projection's) plus attention. oneDNN's prepacked matmul reaches ~80 % of one core's FMA
// rate at these shapes, one parallel region (fork, join) per projection; the plain-layout
// GEMV (gemv.cpp) pays a horizontal sum per output and loses above ~8 rows. Here the
// weight is reordered at load into panels of P = NR * V output columns, each panel
// [K][P] contiguous: the kernel streams a panel once from DRAM (one sequential stream per
// thread) and, for each MR-row chunk of x, keeps MR x NR vector accumulators in registers
// over K, each step one broadcast x value times NR weight vectors; no horizontal sums.
// Each output is one fp32 FMA chain over k = 0 .. K-1 in order, so a row's result does not
// depend on how many rows the step has or which chunk it falls in.
//
// `pdserve_gemm_packed_team` runs inside an enclosing OpenMP parallel region (every thread
// of the team calls it; panels split statically, no barrier at the end): the whole decode
// forward of decode_forward.cpp is one parallel region. `pdserve_gemm_packed` opens its
// own. Vector paths by -march (kernels/native.py): AVX-512 (V 16, MR 8), AVX2 + FMA (V 8,
// MR 6), plain C++ (V 1, MR 4); the packed layout is the build's own (pack with the same
// library). Called through ctypes (kernels/cpu_packed.py): no torch headers.

#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

#include "exp_approx.h"

namespace {

#if defined(__AVX512F__)
constexpr int V = 16;
constexpr int MR = 8;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int V = 8;
constexpr int MR = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 ymm
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
#else
constexpr int V = 1;
constexpr int MR = 4;
using vf = float;
inline vf vzero() { return 0.0f; }
inline vf vload(const float* p) { return *p; }
inline vf vbcast(const float* p) { return *p; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline void vstore(float* p, vf v) { *p = v; }
#endif
constexpr int NR = 2;       // weight vectors a panel row: gate and up for a gate_up weight
constexpr int P = NR * V;   // weight columns a panel (a gate_up panel: V outputs)
constexpr int64_t PF = 16;  // panel rows prefetched ahead (a panel's first chunk streams it)

// Output columns a panel gives: P, or V for a gate_up weight (gate and up side by side).
inline int64_t cols_per_panel(bool silu) { return silu ? V : P; }
inline int64_t panels(int64_t n, bool silu) {
  return (n + cols_per_panel(silu) - 1) / cols_per_panel(silu);
}

// Panels [p0, p1) of w [n (2 n with silu), k] (rows ws apart) into out, zero past the end.
void pack_panels(const float* w, int64_t ws, int64_t n, int64_t k, bool silu, float* out,
                 int64_t p0, int64_t p1) {
  constexpr int64_t KB = 16;  // k values a column at a time: contiguous reads, whole-row writes
  for (int64_t p = p0; p < p1; ++p) {
    float* dst = out + p * k * P;
    const float* src[P];
    for (int64_t c = 0; c < P; ++c) {
      // plain: column p P + c; gate_up: vector c / V is gate (0) or up (1) of output p V + c % V
      const int64_t j = silu ? p * V + c % V : p * P + c;
      src[c] = j < n ? w + (silu && c >= V ? n + j : j) * ws : nullptr;
    }
    for (int64_t k0 = 0; k0 < k; k0 += KB) {
      const int64_t kb = std::min(KB, k - k0);
      float tile[P][KB];
      for (int64_t c = 0; c < P; ++c)
        for (int64_t i = 0; i < kb; ++i) tile[c][i] = src[c] != nullptr ? src[c][k0 + i] : 0.0f;
      for (int64_t i = 0; i < kb; ++i)
        for (int64_t c = 0; c < P; ++c) dst[(k0 + i) * P + c] = tile[c][i];
    }
  }
}

// R rows of x (rows xs apart) times one panel: acc [R][NR] vectors, then the epilogue into
// the panel's output columns [j0, j0 + cols) of y.
// pf: where this chunk's share of the next panel starts (null: none), pf_step bytes of it a
// k step (prefetched into L2 while this panel computes from L1/L2).
template <int R>
inline void micro(const float* x, int64_t xs, const float* wp, int64_t k, bool silu,
                  const float* bias, const float* res, int64_t rs, float* y, int64_t ys,
                  int64_t j0, int64_t cols, bool prefetch, const char* pf, int64_t pf_step) {
  vf acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NR; ++v) acc[r][v] = vzero();
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* wr = wp + kk * P;
    vf w[NR];
    for (int v = 0; v < NR; ++v) w[v] = vload(wr + v * V);
    if (prefetch) __builtin_prefetch(wr + PF * P, 0, 3);
    if (pf != nullptr) {
      const char* a = pf + kk * pf_step;
      __builtin_prefetch(a, 0, 2);
      if (pf_step > 64) __builtin_prefetch(a + 64, 0, 2);
    }
    for (int r = 0; r < R; ++r) {
      const vf b = vbcast(x + r * xs + kk);
      for (int v = 0; v < NR; ++v) acc[r][v] = vfma(b, w[v], acc[r][v]);
    }
  }
  alignas(64) float t[NR * V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NR; ++v) vstore(t + v * V, acc[r][v]);
    float* yr = y + r * ys + j0;
    if (silu) {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const float g = t[c];
        yr[c] = g / (1.0f + pdserve_cpu::exp_approx(-g)) * t[V + c];
      }
    } else {
      const float* rr = res != nullptr ? res + r * rs + j0 : nullptr;
      for (int64_t c = 0; c < cols; ++c) {
        float s = t[c];
        if (bias != nullptr) s += bias[j0 + c];
        if (rr != nullptr) s += rr[c];
        yr[c] = s;
      }
    }
  }
}

template <int R>
inline void rows_chunk(const float* x, int64_t xs, const float* wp, int64_t k, bool silu,
                       const float* bias, const float* res, int64_t rs, float* y, int64_t ys,
                       int64_t j0, int64_t cols, int64_t rows, bool prefetch, const char* pf,
                       int64_t pf_step) {
  if constexpr (R > 1) {
    if (rows < R)
      return rows_chunk<R - 1>(x, xs, wp, k, silu, bias, res, rs, y, ys, j0, cols, rows,
                               prefetch, pf, pf_step);
  }
  micro<R>(x, xs, wp, k, silu, bias, res, rs, y, ys, j0, cols, prefetch, pf, pf_step);
}

// Panels [p0, p1) for all m rows.
void gemm_panels(const float* x, int64_t xs, const float* wp, int64_t n, int64_t k, bool silu,
                 const float* bias, const float* res, int64_t rs, float* y, int64_t ys,
                 int64_t m, int64_t p0, int64_t p1) {
  const int64_t cp = cols_per_panel(silu);
  // The next panel streams from DRAM while this one computes: chunk c of n prefetches the
  // c-th n-th of it, so the read is spread over the whole panel's time, not bunched into
  // its first chunk (which then ran memory-bound). The thread's first panel prefetches
  // itself PF rows ahead in its first chunk.
  const int64_t chunks = (m + MR - 1) / MR;
  const int64_t panel_bytes = k * P * static_cast<int64_t>(sizeof(float));
  const int64_t pf_step = std::max<int64_t>(1, P * static_cast<int64_t>(sizeof(float)) / chunks);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t j0 = p * cp, cols = std::min(cp, n - j0);
    const float* wpp = wp + p * k * P;
    const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(wpp + k * P) : nullptr;
    for (int64_t c = 0, m0 = 0; m0 < m; ++c, m0 += MR)
      rows_chunk<MR>(x + m0 * xs, xs, wpp, k, silu, bias, res == nullptr ? nullptr : res + m0 * rs,
                     rs, y + m0 * ys, ys, j0, cols, std::min<int64_t>(MR, m - m0),
                     p == p0 && m0 == 0, next == nullptr ? nullptr : next + c * panel_bytes / chunks,
                     pf_step);
  }
}

// This thread's share of the panels, for a team of nt threads.
void gemm_team(const float* x, int64_t xs, const float* wp, int64_t n, int64_t k, bool silu,
               const float* bias, const float* res, int64_t rs, float* y, int64_t ys,
               int64_t m, int64_t t, int64_t nt) {
  const int64_t np = panels(n, silu);
  gemm_panels(x, xs, wp, n, k, silu, bias, res, rs, y, ys, m, np * t / nt, np * (t + 1) / nt);
}

bool bad_args(int64_t n, int64_t k, int silu, const float* bias, int64_t m) {
  return n < 0 || k < 0 || m < 0 || (silu != 0 && bias != nullptr);
}

}  // namespace

extern "C" {

// Floats of the packed copy of an [n, k] weight (silu: a [2 n, k] gate_up weight).
int64_t pdserve_packed_floats(int64_t n, int64_t k, int silu) {
  return panels(n, silu != 0) * k * P;
}

// Pack w [n, k] (silu: [2 n, k], gate rows then up rows; rows ws floats apart) into out
// (pdserve_packed_floats floats). Returns 0, 1 on bad arguments.
int pdserve_pack(const float* w, int64_t ws, int64_t n, int64_t k, int silu, float* out,
                 int threads) {
  if (n < 0 || k < 0 || ws < k || threads < 1) return 1;
  const int64_t np = panels(n, silu != 0);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    pack_panels(w, ws, n, k, silu != 0, out, np * t / nt, np * (t + 1) / nt);
  }
  return 0;
}

// y [m, n] (rows ys apart) = x [m, k] (rows xs apart) times the packed weight wp, + bias [n]
// (may be null) + res [m, n] (rows rs apart; may be null); silu: y = silu(gate) * up of a
// packed gate_up weight (no bias, no res). Opens its own parallel region of `threads`.
int pdserve_gemm_packed(const float* x, int64_t xs, const float* wp, int64_t n, int64_t k,
                        int silu, const float* bias, const float* res, int64_t rs, float* y,
                        int64_t ys, int64_t m, int threads) {
  if (bad_args(n, k, silu, bias, m) || threads < 1) return 1;
  threads = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, panels(n, silu))));
#pragma omp parallel num_threads(threads) if (threads > 1)
  gemm_team(x, xs, wp, n, k, silu != 0, bias, res, rs, y, ys, m, omp_get_thread_num(),
            omp_get_num_threads());
  return 0;
}

// The same, called by every thread of an enclosing parallel region: this thread computes
// its share of the panels and returns (the caller synchronises before reading y).
int pdserve_gemm_packed_team(const float* x, int64_t xs, const float* wp, int64_t n, int64_t k,
                             int silu, const float* bias, const float* res, int64_t rs,
                             float* y, int64_t ys, int64_t m) {
  if (bad_args(n, k, silu, bias, m)) return 1;
  gemm_team(x, xs, wp, n, k, silu != 0, bias, res, rs, y, ys, m, omp_get_thread_num(),
            omp_get_num_threads());
  return 0;
}

// The build's vector width in bits (512, 256, 32); the packed layout depends on it.
int pdserve_gemm_packed_isa() { return V * 32; }

}  // extern "C"

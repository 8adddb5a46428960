// GEMMs on weights packed once into column panels, for decode steps of many rows, fp32 or
// bf16: y[m, j] = sum_k x[m, k] * w[j, k] (+ b[j]) (+ res[m, j]), or for a gate_up weight
// [2 N, K] (gate rows, then up rows) y[m, j] = silu(gate_j) * up_j.
//
// Why: a decode step of 32-64 sequences is weight-streaming GEMMs (M = rows, K and N the
// projection's) plus attention. oneDNN's prepacked matmul comes close to one core's FMA
// rate at these shapes, one parallel region (fork, join) per projection; the plain-layout
// GEMV (gemv.cpp) pays a horizontal sum per output and loses above ~8 rows. Here the
// weight is reordered at load into panels of P = NR * V output columns, each panel
// contiguous: the kernel streams a panel once from DRAM (one sequential stream per thread)
// and, for each MR-row chunk of x, keeps MR x NR fp32 vector accumulators in registers
// over K, each step one broadcast x value times NR weight vectors; no horizontal sums.
//
// fp32: a panel is [K][P] floats; each output is one fp32 FMA chain over k = 0 .. K-1.
// bf16: a panel is [ceil(K / 2)][P][2] bf16, the two k of a pair side by side (a zero
// past an odd K), so one vector holds V columns x 2 k: on a CPU with avx512_bf16 one
// vdpbf16ps adds both products of a pair to each column's fp32 accumulator (x's pair
// broadcast as one 32-bit value); elsewhere the pair is widened to fp32 and FMA'd (even k,
// then odd). Accumulation is fp32 in both; results are rounded to bf16 where the per-op
// path's bf16 tensors round (the GEMM's output, then the residual sum; SiLU(gate), then
// its product with up; gate and up themselves too where the per-op path's gate_up GEMM
// is not fused with SiLU: `silu` mode 2), so they match it but for summation order.
// Either way a row's result does not depend on how many rows the step has, which chunk it
// falls in or how many threads run it.
//
// `pdserve_gemm_packed[_bf16]_team` runs inside an enclosing OpenMP parallel region (every
// thread of the team calls it; panels split statically, no barrier at the end): the whole
// decode forward of decode_forward.cpp is one parallel region. `pdserve_gemm_packed[_bf16]`
// opens its own. Vector paths by -march (kernels/native.py): AVX-512 (V 16, MR 8; bf16 on
// vdpbf16ps MR 12 from kTallRows rows), AVX2 + FMA (V 8, MR 6), plain C++ (V 1, MR 4); the
// packed layout is the build's own (pack with the same library). bf16 on a CPU with AMX:
// the same panels as AMX tiles (gemm_panels_amx; built with PDSERVE_AMX_EMULATE, on tiles
// in software, amx_emulate.h, for tests on an AVX-512 bf16 CPU without AMX). Called through ctypes
// (kernels/gemm_packed.py): no torch headers.

#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(PDSERVE_AMX_EMULATE) && defined(__AVX512BF16__)
// the AMX path on tiles in software, for tests on a CPU without AMX (amx_emulate.h)
#include "amx_emulate.h"
#define PDSERVE_GEMM_AMX 1
#define TILE_CONFIG(c) pdserve_amx_emulate::loadconfig(c)
#define TILE_RELEASE() pdserve_amx_emulate::release()
#define TILE_ZERO(t) pdserve_amx_emulate::zero(t)
#define TILE_LOAD(t, p, s) pdserve_amx_emulate::loadd(t, p, s)
#define TILE_STORE(t, p, s) pdserve_amx_emulate::stored(t, p, s)
#define TILE_DP(c, a, b) pdserve_amx_emulate::dpbf16ps(c, a, b)
#elif defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define PDSERVE_GEMM_AMX 1
#define PDSERVE_AMX_HARDWARE 1
#define TILE_CONFIG(c) _tile_loadconfig(c)
#define TILE_RELEASE() _tile_release()
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, p, s) _tile_loadd(t, p, s)
#define TILE_STORE(t, p, s) _tile_stored(t, p, s)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"
#include "exp_approx.h"

namespace {

// `silu` argument of the GEMMs: 0 a plain projection; 1 silu(gate) * up of the fp32
// accumulators (as oneDNN's post-ops on a packed gate_up weight compute it); 2 gate and up
// rounded to the weight's dtype first (as the unfused per-op path computes it: the gate_up
// GEMM's bf16 output, then silu_and_mul; where oneDNN has no native bf16). fp32: 1 == 2.
constexpr int kSiluRoundedInputs = 2;

using pdserve_cpu::bf16_to_float;
using pdserve_cpu::float_to_bf16;
using pdserve_cpu::load;
using pdserve_cpu::store;

#if defined(__AVX512F__)
constexpr int V = 16;
constexpr int MR = 8;
using vf = __m512;
using vi = __m512i;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void vstream(float* p, vf v) { _mm512_stream_ps(p, v); }  // p 64-byte aligned
inline vi viload(const void* p) { return _mm512_loadu_si512(p); }
inline vi vibcast(uint32_t u) { return _mm512_set1_epi32(static_cast<int>(u)); }
inline vf even_f32(vi v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline vf odd_f32(vi v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int V = 8;
constexpr int MR = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 ymm
using vf = __m256;
using vi = __m256i;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
// _mm256_set1_ps, not _mm256_broadcast_ss(p): through that builtin's pointer GCC kept the
// accumulator array in memory too, a store of every accumulator every k step, which
// halved the AVX2 fp32 kernel's rate (docs/benchmarks-history.md, "The AVX2 build")
inline vf vbcast(const float* p) { return _mm256_set1_ps(*p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void vstream(float* p, vf v) { _mm256_stream_ps(p, v); }  // p 32-byte aligned
inline vi viload(const void* p) { return _mm256_loadu_si256(static_cast<const vi*>(p)); }
inline vi vibcast(uint32_t u) { return _mm256_set1_epi32(static_cast<int>(u)); }
inline vf even_f32(vi v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline vf odd_f32(vi v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
#else
constexpr int V = 1;
constexpr int MR = 4;
using vf = float;
using vi = uint32_t;
inline vf vzero() { return 0.0f; }
inline vf vload(const float* p) { return *p; }
inline vf vbcast(const float* p) { return *p; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline void vstore(float* p, vf v) { *p = v; }
inline void vstream(float* p, vf v) { *p = v; }
inline vi viload(const void* p) {
  vi u;
  std::memcpy(&u, p, sizeof(u));
  return u;
}
inline vi vibcast(uint32_t u) { return u; }
inline vf even_f32(vi v) { return bf16_to_float(static_cast<uint16_t>(v & 0xffffu)); }
inline vf odd_f32(vi v) { return bf16_to_float(static_cast<uint16_t>(v >> 16)); }
#endif
constexpr int NR = 2;       // weight vectors a panel row: gate and up for a gate_up weight
constexpr int P = NR * V;   // weight columns a panel (a gate_up panel: V outputs)
constexpr int64_t PF = 16;  // panel rows prefetched ahead into L1 (Prefetcher)
// Where the next panel is prefetched by the first kEarlyChunks row chunks only
// (gemm_panels_block): the AVX2 build's fp32 GEMMs.
template <typename T>
constexpr bool kEarlyNextPanel = V == 8 && sizeof(T) == 4;
constexpr int64_t kEarlyChunks = 2;

// The output type of the logits GEMMs (pdserve_gemm_packed[_bf16]_logits): fp32 written
// with non-temporal stores wherever a store is a whole vector at an aligned address. The
// lm_head's output ([rows, vocab] fp32, 6.3 MB at 32 rows of SmolLM2) is far larger than
// L2 and is read once, later, by the sampler; stored the usual way, each of its lines is
// first read from memory (the store's read for ownership) and each micro kernel's rows
// land 4 * vocab bytes apart. Streamed, the default model's lm_head took 11 % less time
// in bf16 and 5 % less in fp32 at 32 rows on Zen 4 (docs/benchmarks.md, "The lm_head's
// logits written past the caches").
struct StreamedF32 {
  float v;
};
inline void store(StreamedF32* p, float x) { p->v = x; }
inline float* plain(StreamedF32* p) { return reinterpret_cast<float*>(p); }
inline bool vec_aligned(const void* p, int64_t row_stride_floats) {
  constexpr uintptr_t kBytes = V * sizeof(float);
  return ((reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(row_stride_floats) * 4) %
          kBytes) == 0;
}

// A bf16 pair of x (k, k + 1) as the weight pairs hold theirs, and one k-pair step of the
// accumulator: acc += x_even w_even + x_odd w_odd for each column of the weight vector.
#if defined(__AVX512BF16__)
constexpr bool kNativeBf16 = true;
using xpair = __m512bh;
using wpair = __m512bh;
inline xpair xprep(uint32_t u) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(u)); }
inline wpair wprep(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline vf dot2(vf acc, xpair x, wpair w) { return _mm512_dpbf16_ps(acc, x, w); }
#else
constexpr bool kNativeBf16 = false;
struct xpair { vf e, o; };
struct wpair { vf e, o; };
inline xpair xprep(uint32_t u) {
  const vi b = vibcast(u);
  return {even_f32(b), odd_f32(b)};
}
inline wpair wprep(const uint16_t* p) {
  const vi w = viload(p);
  return {even_f32(w), odd_f32(w)};
}
inline vf dot2(vf acc, xpair x, wpair w) { return vfma(x.o, w.o, vfma(x.e, w.e, acc)); }
#endif

// Element traits: KP k values a packed group (1 fp32, 2 bf16), and the value a tensor of
// that dtype holds (bf16: rounded).
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static constexpr int64_t KP = 1;
  static float rnd(float x) { return x; }
};
template <>
struct Elem<uint16_t> {
  static constexpr int64_t KP = 2;
  static float rnd(float x) { return bf16_to_float(float_to_bf16(x)); }
};

// Output columns a panel gives: P, or V for a gate_up weight (gate and up side by side).
inline int64_t cols_per_panel(bool silu) { return silu ? V : P; }
inline int64_t panels(int64_t n, bool silu) {
  return (n + cols_per_panel(silu) - 1) / cols_per_panel(silu);
}
// Elements of one packed panel: ceil(k / KP) groups of P columns x KP.
template <typename T>
inline int64_t panel_elems(int64_t k) {
  constexpr int64_t KP = Elem<T>::KP;
  return (k + KP - 1) / KP * P * KP;
}

// Panels [p0, p1) of w [n (2 n with silu), k] (rows ws apart) into out, zero past the end.
template <typename T>
void pack_panels(const T* w, int64_t ws, int64_t n, int64_t k, bool silu, T* out, int64_t p0,
                 int64_t p1) {
  constexpr int64_t KB = 16;  // k values a column at a time: contiguous reads, whole-row writes
  constexpr int64_t KP = Elem<T>::KP;
  const int64_t kpad = (k + KP - 1) / KP * KP;
  for (int64_t p = p0; p < p1; ++p) {
    T* dst = out + p * panel_elems<T>(k);
    const T* src[P];
    for (int64_t c = 0; c < P; ++c) {
      // plain: column p P + c; gate_up: vector c / V is gate (0) or up (1) of output p V + c % V
      const int64_t j = silu ? p * V + c % V : p * P + c;
      src[c] = j < n ? w + (silu && c >= V ? n + j : j) * ws : nullptr;
    }
    for (int64_t k0 = 0; k0 < kpad; k0 += KB) {
      const int64_t kb = std::min(KB, kpad - k0);
      T tile[P][KB];
      for (int64_t c = 0; c < P; ++c)
        for (int64_t i = 0; i < kb; ++i)
          tile[c][i] = src[c] != nullptr && k0 + i < k ? src[c][k0 + i] : T(0);
      for (int64_t i = 0; i < kb; ++i) {
        const int64_t kk = k0 + i;
        for (int64_t c = 0; c < P; ++c) dst[(kk / KP * P + c) * KP + kk % KP] = tile[c][i];
      }
    }
  }
}

// The epilogue of R rows: acc [R][NR] vectors into the panel's output columns [j0, j0 +
// cols) of y, with bias, residual or SiLU * up, rounded where T's tensors would round.
template <typename T, typename Y, int R>
inline void epilogue(vf (&acc)[R][NR], int silu, const T* bias, const T* res, int64_t rs,
                     Y* y, int64_t ys, int64_t j0, int64_t cols) {
  using E = Elem<T>;
  if constexpr (std::is_same_v<Y, StreamedF32> && std::is_same_v<T, float>) {
    float* y0 = plain(y + j0);
    if (silu == 0 && bias == nullptr && res == nullptr && cols == P && vec_aligned(y0, ys)) {
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NR; ++v) vstream(y0 + r * ys + v * V, acc[r][v]);
      return;
    }
  }
  alignas(64) float t[NR * V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NR; ++v) vstore(t + v * V, acc[r][v]);
    Y* yr = y + r * ys + j0;
    if (silu == kSiluRoundedInputs) {  // gate and up rounded first, as T tensors would be
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const float g = E::rnd(t[c]);
        store(yr + c,
              E::rnd(E::rnd(g / (1.0f + pdserve_cpu::exp_approx(-g))) * E::rnd(t[V + c])));
      }
    } else if (silu != 0) {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        const float g = t[c];
        store(yr + c, E::rnd(E::rnd(g / (1.0f + pdserve_cpu::exp_approx(-g))) * t[V + c]));
      }
    } else {
      const T* rr = res != nullptr ? res + r * rs + j0 : nullptr;
      if (bias != nullptr)
        for (int64_t c = 0; c < cols; ++c) t[c] += load(bias + j0 + c);
      if (rr != nullptr) {
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) store(yr + c, E::rnd(E::rnd(t[c]) + load(rr + c)));
      } else {
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) store(yr + c, E::rnd(t[c]));
      }
    }
  }
}

#if defined(__AVX512BF16__)
// exp_approx on 16 lanes, the same operations in the same order (mul then add: this file
// is built without FMA contraction), so the same bits as the scalar code's.
inline __m512 exp_approx_v(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 fi = _mm512_sub_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)), magic), magic);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(fi, _mm512_set1_ps(0.693145751953125f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(fi, _mm512_set1_ps(1.428606765330187e-06f)));
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  const float coef[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
  for (float c : coef) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fi), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// y = the value a bf16 tensor holds: bf16 (Y uint16_t) or fp32 holding it (Y float).
inline void store_rounded(uint16_t* y, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(y, m, pdserve_cpu::float_to_bf16_v(v));
}
inline void store_rounded(float* y, __mmask16 m, __m512 v) {
  _mm512_mask_storeu_ps(y, m, pdserve_cpu::round_bf16_v(v));
}
inline void store_rounded(StreamedF32* y, __mmask16 m, __m512 v) {
  if (m == 0xFFFF && vec_aligned(y, 0))
    _mm512_stream_ps(plain(y), pdserve_cpu::round_bf16_v(v));
  else
    store_rounded(plain(y), m, v);
}

// `epilogue<uint16_t, Y, R>` for the rows of a stored C block (row r: 2 vectors of fp32
// sums), on 16-lane intrinsics: the same roundings (bf16.h float_to_bf16_v: the same bits
// as float_to_bf16) and exp, so the same bits; one call a block, not a call a row. The
// bf16 micro kernel's (its SiLU * up ~10 % faster than the scalar loop's) and the AMX
// path's.
template <typename Y>
void epilogue_block(const float (*c)[P], int64_t rows, int silu, const uint16_t* bias,
                    const uint16_t* res, int64_t rs, Y* y, int64_t ys, int64_t j0, int64_t cols) {
  using pdserve_cpu::load_bf16_v;
  using pdserve_cpu::round_bf16_v;
  const __m512 one = _mm512_set1_ps(1.0f);
  if (silu != 0) {  // cols <= V: gate in vector 0, up in vector 1
    const __mmask16 m = pdserve_cpu::lanes(cols);
    for (int64_t r = 0; r < rows; ++r) {
      __m512 g = _mm512_load_ps(&c[r][0]), u = _mm512_load_ps(&c[r][V]);
      if (silu == kSiluRoundedInputs) {
        g = round_bf16_v(g);
        u = round_bf16_v(u);
      }
      const __m512 e = exp_approx_v(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 s = round_bf16_v(_mm512_div_ps(g, _mm512_add_ps(one, e)));
      store_rounded(y + r * ys + j0, m, _mm512_mul_ps(s, u));
    }
    return;
  }
  for (int64_t h = 0; h < NR; ++h) {
    const int64_t c0 = h * V;
    if (c0 >= cols) break;
    const __mmask16 m = pdserve_cpu::lanes(cols - c0);
    const __m512 b = bias != nullptr ? load_bf16_v(m, bias + j0 + c0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      __m512 t = _mm512_load_ps(&c[r][c0]);
      if (bias != nullptr) t = _mm512_add_ps(t, b);
      if (res != nullptr)
        t = _mm512_add_ps(round_bf16_v(t), load_bf16_v(m, res + r * rs + j0 + c0));
      store_rounded(y + r * ys + j0 + c0, m, t);
    }
  }
}

#endif

// A micro kernel's prefetches, one k step at a time, with no branch in the k loop (the
// tests and loads a branch takes cost a bf16 k pair ~6 % of its 16 vdpbf16ps, hot in L2):
// the current panel `ahead` elements on into L1 (a panel, 36-110 KiB for the default model,
// is larger than L1 and each chunk of rows reads it again from L2), and this chunk's share
// of the next panel into L2, `step` bytes a k step (one line, two above 64 bytes); with no
// next panel, the current panel's first line again, already cached.
class Prefetcher {
 public:
  Prefetcher(const void* cur, const char* next, int64_t step)
      : next_(next != nullptr ? next : static_cast<const char*>(cur)),
        step_(next != nullptr ? step : 0),
        second_(next != nullptr && step > 64 ? 64 : 0) {}
  template <typename T>
  void at(const T* w, int64_t ahead, int64_t s) const {
    __builtin_prefetch(w + ahead, 0, 3);
    const char* a = next_ + s * step_;
    __builtin_prefetch(a, 0, 2);
    __builtin_prefetch(a + second_, 0, 2);
  }

 private:
  const char* next_;
  int64_t step_, second_;
};

// R rows of x (rows xs apart) times one panel, then the epilogue.
// pf: where this chunk's share of the next panel starts (null: none), pf_step bytes of it a
// k group (prefetched into L2 while this panel computes from L1/L2).
template <int R, typename Y>
inline void micro(const float* x, int64_t xs, const float* wp, int64_t k, int silu,
                  const float* bias, const float* res, int64_t rs, Y* y, int64_t ys, int64_t j0,
                  int64_t cols, const char* pf, int64_t pf_step) {
  const Prefetcher pre(wp, pf, pf_step);
  vf acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NR; ++v) acc[r][v] = vzero();
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* wr = wp + kk * P;
    vf w[NR];
    for (int v = 0; v < NR; ++v) w[v] = vload(wr + v * V);
    pre.at(wr, PF * P, kk);
    for (int r = 0; r < R; ++r) {
      const vf b = vbcast(x + r * xs + kk);
      for (int v = 0; v < NR; ++v) acc[r][v] = vfma(b, w[v], acc[r][v]);
    }
  }
  epilogue<float, Y, R>(acc, silu, bias, res, rs, y, ys, j0, cols);
}

inline uint32_t x_pair(const uint16_t* x, int64_t kk, int64_t k) {
  uint32_t u = x[kk];
  if (kk + 1 < k) u |= static_cast<uint32_t>(x[kk + 1]) << 16;
  return u;
}

template <int R, typename Y>
inline void micro(const uint16_t* x, int64_t xs, const uint16_t* wp, int64_t k, int silu,
                  const uint16_t* bias, const uint16_t* res, int64_t rs, Y* y, int64_t ys,
                  int64_t j0, int64_t cols, const char* pf, int64_t pf_step) {
  const Prefetcher pre(wp, pf, pf_step);
  vf acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NR; ++v) acc[r][v] = vzero();
  const int64_t groups = (k + 1) / 2, full = k / 2;
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t* wr = wp + g * (2 * P);
    wpair w[NR];
    for (int v = 0; v < NR; ++v) w[v] = wprep(wr + v * 2 * V);
    pre.at(wr, PF * 2 * P, g);
    for (int r = 0; r < R; ++r) {
      uint32_t u;
      if (g < full)
        std::memcpy(&u, x + r * xs + 2 * g, sizeof(u));
      else
        u = x_pair(x + r * xs, 2 * g, k);  // an odd K's last k, its pair partner zero
      const xpair b = xprep(u);
      for (int v = 0; v < NR; ++v) acc[r][v] = dot2(acc[r][v], b, w[v]);
    }
  }
#if defined(__AVX512BF16__)
  alignas(64) float c[R][P];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NR; ++v) vstore(&c[r][v * V], acc[r][v]);
  epilogue_block(c, R, silu, bias, res, rs, y, ys, j0, cols);
#else
  epilogue<uint16_t, Y, R>(acc, silu, bias, res, rs, y, ys, j0, cols);
#endif
}

template <int R, typename T, typename Y>
inline void rows_chunk(const T* x, int64_t xs, const T* wp, int64_t k, int silu, const T* bias,
                       const T* res, int64_t rs, Y* y, int64_t ys, int64_t j0, int64_t cols,
                       int64_t rows, const char* pf, int64_t pf_step) {
  if constexpr (R > 1) {
    if (rows < R)
      return rows_chunk<R - 1>(x, xs, wp, k, silu, bias, res, rs, y, ys, j0, cols, rows, pf,
                               pf_step);
  }
  micro<R>(x, xs, wp, k, silu, bias, res, rs, y, ys, j0, cols, pf, pf_step);
}

#if defined(PDSERVE_GEMM_AMX)
// bf16 on AMX tiles (Sapphire Rapids on), the same packed panels: a panel's k pairs
// g .. g + 15 of weight vector v are a 16 x 64-byte tile, rows 2 P bf16 apart, which is
// the layout TDPBF16PS takes for B; x's rows are the A tiles (16 rows x 32 k). Per panel
// and 32-row chunk of x, C is 2 x 2 tiles of 16 x 16 fp32 (rows, vectors), one
// TDPBF16PS chain over k; then the epilogue, row by row, from the stored C. oneDNN's AMX
// GEMMs stream cold weights at ~12 GB/s at decode row counts on the benchmark box (2
// threads, DRAM reads ~23 GB/s); this, one sequential stream per thread, at ~20.
// Accumulation is fp32 (TDPBF16PS: each pair's two products, then the sum, as
// vdpbf16ps: products of bf16 are exact, denormals read as zero), so results match the
// vdpbf16ps path's but for summation order, and a row's result still does not depend on
// the row count or thread split. Taken for every call where K is a multiple of 32 (whole
// A / B tiles; the model shapes) once Linux has granted the process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM); otherwise the vdpbf16ps path.
constexpr int64_t kAmxK = 32;  // k values a tile row (16 pairs)

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_granted() {
#if defined(PDSERVE_AMX_HARDWARE)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
#else
  return true;  // tiles in software
#endif
}

// Tiles 0-3: C of rows 0-15 (vector 0, 1) and rows 16-31; 4, 5: A of those rows; 6, 7: B.
inline void amx_config(int64_t r0, int64_t r1) {
  TileConfig c;
  const int64_t rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows[t] > 0 ? rows[t] : 1);
    c.colsb[t] = 64;
  }
  TILE_CONFIG(&c);
}

template <typename Y>
void gemm_panels_amx(const uint16_t* x, int64_t xs, const uint16_t* wp, int64_t n, int64_t k,
                     int silu, const uint16_t* bias, const uint16_t* res, int64_t rs, Y* y,
                     int64_t ys, int64_t m, int64_t p0, int64_t p1) {
  const int64_t cp = cols_per_panel(silu != 0), pe = panel_elems<uint16_t>(k);
  const int64_t chunk_elems = kAmxK / 2 * 2 * P;  // a k chunk of a panel: 16 pair rows
  alignas(64) float cbuf[32][P];
  int64_t configured = -1;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t j0 = p * cp, cols = std::min(cp, n - j0);
    const uint16_t* wpp = wp + p * pe;
    for (int64_t m0 = 0; m0 < m; m0 += 32) {
      const int64_t rows = std::min<int64_t>(32, m - m0);
      if (rows != configured) {
        amx_config(std::min<int64_t>(16, rows), rows - 16);
        configured = rows;
      }
      const bool two = rows > 16;
      const uint16_t* x0 = x + m0 * xs;
      const uint16_t* x1 = x0 + 16 * xs;
      TILE_ZERO(0);
      TILE_ZERO(1);
      if (two) {
        TILE_ZERO(2);
        TILE_ZERO(3);
      }
      for (int64_t k0 = 0, c = 0; k0 < k; k0 += kAmxK, ++c) {
        const uint16_t* b = wpp + c * chunk_elems;
        _mm_prefetch(reinterpret_cast<const char*>(b + 4 * chunk_elems), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b + 4 * chunk_elems + 512), _MM_HINT_T0);
        TILE_LOAD(4, x0 + k0, xs * 2);
        TILE_LOAD(6, b, 2 * P * 2);
        TILE_LOAD(7, b + 2 * V, 2 * P * 2);
        TILE_DP(0, 4, 6);
        TILE_DP(1, 4, 7);
        if (two) {
          TILE_LOAD(5, x1 + k0, xs * 2);
          TILE_DP(2, 5, 6);
          TILE_DP(3, 5, 7);
        }
      }
      TILE_STORE(0, &cbuf[0][0], P * 4);
      TILE_STORE(1, &cbuf[0][V], P * 4);
      if (two) {
        TILE_STORE(2, &cbuf[16][0], P * 4);
        TILE_STORE(3, &cbuf[16][V], P * 4);
      }
      epilogue_block(cbuf, rows, silu, bias, res == nullptr ? nullptr : res + m0 * rs, rs,
                     y + m0 * ys, ys, j0, cols);
    }
  }
  if (configured >= 0) TILE_RELEASE();
}
#endif

// Whether the bf16 GEMMs of a K run on AMX tiles (gemm_panels_amx).
inline bool amx_takes(int64_t k) {
#if defined(PDSERVE_GEMM_AMX)
  static_assert(V == 16 && NR == 2, "a panel row is two 16-column vectors");
  return k > 0 && k % kAmxK == 0 && amx_granted();
#else
  (void)k;
  return false;
#endif
}

// Panels [p0, p1) for m rows, in chunks of RC rows.
template <int RC, typename T, typename Y>
void gemm_panels_block(const T* x, int64_t xs, const T* wp, int64_t n, int64_t k, int silu,
                       const T* bias, const T* res, int64_t rs, Y* y, int64_t ys, int64_t m,
                       int64_t p0, int64_t p1) {
  const int64_t cp = cols_per_panel(silu != 0), pe = panel_elems<T>(k);
  // The next panel streams from DRAM while this one computes: the first `ahead` chunks
  // each prefetch their share of it (chunk c the c-th), not bunched into one chunk (which
  // then ran memory-bound). Most builds spread it over every chunk. The AVX2 build's fp32
  // GEMMs ask for it in the first kEarlyChunks chunks, a line a k step: spread to the
  // panel's end (6 chunks of 6 rows at 32 rows) its panels arrived late, and its fp32
  // GEMMs on cold weights took 4-13 % longer (`benchmarks/weight_forms.py --cold 30` under
  // scripts/avx2_cap.sh, docs/benchmarks.md). The AVX-512 build's fp32 (4 chunks of 8) and
  // AVX2's bf16 measured the same or 2-3 % slower with it, so they keep the spread. Each
  // chunk also prefetches its panel PF rows ahead into L1 (Prefetcher).
  const int64_t chunks = (m + RC - 1) / RC;
  const int64_t ahead = kEarlyNextPanel<T> ? std::min<int64_t>(chunks, kEarlyChunks) : chunks;
  const int64_t panel_bytes = pe * static_cast<int64_t>(sizeof(T));
  const int64_t group_bytes = P * Elem<T>::KP * static_cast<int64_t>(sizeof(T));
  const int64_t pf_step = std::max<int64_t>(1, group_bytes / ahead);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t j0 = p * cp, cols = std::min(cp, n - j0);
    const T* wpp = wp + p * pe;
    const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(wpp + pe) : nullptr;
    for (int64_t c = 0, m0 = 0; m0 < m; ++c, m0 += RC)
      rows_chunk<RC>(x + m0 * xs, xs, wpp, k, silu, bias, res == nullptr ? nullptr : res + m0 * rs,
                     rs, y + m0 * ys, ys, j0, cols, std::min<int64_t>(RC, m - m0),
                     next == nullptr || c >= ahead ? nullptr : next + c * panel_bytes / ahead,
                     pf_step);
  }
}

// Rows of x in blocks where x is larger than an L2 cache (a prompt step's): each block runs
// every panel of the thread before the next block starts, so x's block stays in L2 while
// the panels stream past it (a panel, 36-110 KiB for the default model, is read again for
// each block from L3 or DRAM). Unblocked, every panel read all of x again from L3: at a
// prompt step of 4096 rows (workload C) the panel GEMM took 1.08x (bf16) and 1.18x (fp32)
// oneDNN's time on Zen 4; blocked 0.98x and 0.94-0.99x (benchmarks/weight_forms.py
// --rows 4096). Decode steps (up to 256 rows, the weights cold) stay unblocked: there a
// second pass over a panel is a second read from DRAM. A row's result is the same either way.
constexpr int64_t kBlockAboveBytes = 2 << 20;  // x larger than this: blocked
constexpr int64_t kRowBlockBytes = 256 << 10;  // x's rows a block (L2 is 512 KiB-2 MiB)

// Panels [p0, p1) for all m rows, in chunks of RC rows, in blocks of rows where x is large.
template <int RC, typename T, typename Y>
void gemm_panels_rc(const T* x, int64_t xs, const T* wp, int64_t n, int64_t k, int silu,
                    const T* bias, const T* res, int64_t rs, Y* y, int64_t ys, int64_t m,
                    int64_t p0, int64_t p1) {
  const int64_t row_bytes = std::max<int64_t>(1, k * static_cast<int64_t>(sizeof(T)));
  int64_t mb = m;
  if (m * row_bytes > kBlockAboveBytes)
    mb = std::max<int64_t>(RC, kRowBlockBytes / row_bytes / RC * RC);
  for (int64_t b0 = 0; b0 < m; b0 += mb)
    gemm_panels_block<RC>(x + b0 * xs, xs, wp, n, k, silu, bias,
                          res == nullptr ? nullptr : res + b0 * rs, rs, y + b0 * ys, ys,
                          std::min(mb, m - b0), p0, p1);
}

// bf16 on vdpbf16ps, calls of kTallRows rows or more: chunks of MR_TALL rows (24
// accumulators + 2 weight vectors + 1 broadcast of the 32 zmm registers), each weight vector
// loaded once for 12 rows, not 8. On Zen 4 (2 threads, the default model's projections,
// benchmarks/weight_forms.py) this took the panel GEMM from 1.03-1.11x oneDNN's time to
// 0.93-0.99x at 64-512 rows; fp32 was as fast or slower with it, so fp32 keeps MR. A row's
// result is the same either way (its own accumulators, k in order).
#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr int MR_TALL = 12;
constexpr int64_t kTallRows = 64;
#endif

// Panels [p0, p1) for all m rows: on AMX tiles where they take the call, else the vector
// micro kernels in chunks of MR rows (MR_TALL for tall bf16 calls).
template <typename T, typename Y>
void gemm_panels(const T* x, int64_t xs, const T* wp, int64_t n, int64_t k, int silu,
                 const T* bias, const T* res, int64_t rs, Y* y, int64_t ys, int64_t m,
                 int64_t p0, int64_t p1) {
#if defined(PDSERVE_GEMM_AMX)
  if constexpr (sizeof(T) == 2) {
    if (amx_takes(k)) {
      if (p0 < p1)
        gemm_panels_amx(x, xs, wp, n, k, silu, bias, res, rs, y, ys, m, p0, p1);
      return;
    }
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (sizeof(T) == 2) {
    if (m >= kTallRows)
      return gemm_panels_rc<MR_TALL>(x, xs, wp, n, k, silu, bias, res, rs, y, ys, m, p0, p1);
  }
#endif
  gemm_panels_rc<MR>(x, xs, wp, n, k, silu, bias, res, rs, y, ys, m, p0, p1);
}

// This thread's share of the panels, for a team of nt threads.
template <typename T, typename Y>
void gemm_team(const T* x, int64_t xs, const T* wp, int64_t n, int64_t k, int silu,
               const T* bias, const T* res, int64_t rs, Y* y, int64_t ys, int64_t m, int64_t t,
               int64_t nt) {
  const int64_t np = panels(n, silu != 0);
  gemm_panels(x, xs, wp, n, k, silu, bias, res, rs, y, ys, m, np * t / nt, np * (t + 1) / nt);
}

bool bad_args(int64_t n, int64_t k, int silu, const void* bias, const void* res, int64_t m) {
  return n < 0 || k < 0 || m < 0 || silu < 0 || silu > kSiluRoundedInputs ||
         (silu != 0 && (bias != nullptr || res != nullptr));
}

template <typename T>
int pack(const T* w, int64_t ws, int64_t n, int64_t k, int silu, T* out, int threads) {
  if (n < 0 || k < 0 || ws < k || threads < 1) return 1;
  const int64_t np = panels(n, silu != 0);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    pack_panels(w, ws, n, k, silu != 0, out, np * t / nt, np * (t + 1) / nt);
  }
  return 0;
}

template <typename T, typename Y>
int gemm_own_region(const T* x, int64_t xs, const T* wp, int64_t n, int64_t k, int silu,
                    const T* bias, const T* res, int64_t rs, Y* y, int64_t ys, int64_t m,
                    int threads) {
  if (bad_args(n, k, silu, bias, res, m) || threads < 1) return 1;
  threads =
      static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, panels(n, silu != 0))));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    gemm_team(x, xs, wp, n, k, silu, bias, res, rs, y, ys, m, omp_get_thread_num(),
              omp_get_num_threads());
    // non-temporal stores are weakly ordered: complete them before anyone reads y
    if constexpr (std::is_same_v<Y, StreamedF32>)
      std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  return 0;
}

}  // namespace

extern "C" {

// Floats of the packed copy of an fp32 [n, k] weight (silu: a [2 n, k] gate_up weight).
int64_t pdserve_packed_floats(int64_t n, int64_t k, int silu) {
  return panels(n, silu != 0) * panel_elems<float>(k);
}

// bf16 elements of the packed copy of a bf16 [n, k] weight (silu: [2 n, k]).
int64_t pdserve_packed_bf16_elems(int64_t n, int64_t k, int silu) {
  return panels(n, silu != 0) * panel_elems<uint16_t>(k);
}

// Pack w [n, k] (silu: [2 n, k], gate rows then up rows; rows ws elements apart) into out
// (pdserve_packed_floats / _bf16_elems elements). Returns 0, 1 on bad arguments.
int pdserve_pack(const float* w, int64_t ws, int64_t n, int64_t k, int silu, float* out,
                 int threads) {
  return pack(w, ws, n, k, silu, out, threads);
}

int pdserve_pack_bf16(const uint16_t* w, int64_t ws, int64_t n, int64_t k, int silu,
                      uint16_t* out, int threads) {
  return pack(w, ws, n, k, silu, out, threads);
}

// y [m, n] (rows ys apart) = x [m, k] (rows xs apart) times the packed weight wp, + bias [n]
// (may be null) + res [m, n] (rows rs apart; may be null); silu 1 or 2: y = silu(gate) *
// up of a packed gate_up weight (no bias, no res; 2: gate and up rounded to T first).
// Opens its own parallel region of `threads`.
// Returns 0, 1 on bad arguments (nothing written).
int pdserve_gemm_packed(const float* x, int64_t xs, const float* wp, int64_t n, int64_t k,
                        int silu, const float* bias, const float* res, int64_t rs, float* y,
                        int64_t ys, int64_t m, int threads) {
  return gemm_own_region(x, xs, wp, n, k, silu, bias, res, rs, y, ys, m, threads);
}

// The same for bf16 x, weight, bias and res; y bf16, or (y_f32) fp32 holding the bf16
// values (the lm_head's logits, as the per-op path's bf16 logits turned float).
int pdserve_gemm_packed_bf16(const uint16_t* x, int64_t xs, const uint16_t* wp, int64_t n,
                             int64_t k, int silu, const uint16_t* bias, const uint16_t* res,
                             int64_t rs, void* y, int64_t ys, int64_t m, int y_f32,
                             int threads) {
  if (y_f32 != 0)
    return gemm_own_region(x, xs, wp, n, k, silu, bias, res, rs, static_cast<float*>(y), ys, m,
                           threads);
  return gemm_own_region(x, xs, wp, n, k, silu, bias, res, rs, static_cast<uint16_t*>(y), ys, m,
                         threads);
}

// The lm_head: fp32 logits y [m, n] (rows ys apart) = x [m, k] (rows xs apart) times the
// packed weight wp (bf16: the bf16 values the per-op path's bf16 logits hold, as y_f32),
// written past the caches (StreamedF32: a large output read once, later). Opens its own
// parallel region of `threads`. Returns 0, 1 on bad arguments (nothing written).
int pdserve_gemm_packed_logits(const float* x, int64_t xs, const float* wp, int64_t n,
                               int64_t k, float* y, int64_t ys, int64_t m, int threads) {
  return gemm_own_region(x, xs, wp, n, k, 0, static_cast<const float*>(nullptr),
                         static_cast<const float*>(nullptr), 0,
                         reinterpret_cast<StreamedF32*>(y), ys, m, threads);
}

int pdserve_gemm_packed_bf16_logits(const uint16_t* x, int64_t xs, const uint16_t* wp,
                                    int64_t n, int64_t k, float* y, int64_t ys, int64_t m,
                                    int threads) {
  return gemm_own_region(x, xs, wp, n, k, 0, static_cast<const uint16_t*>(nullptr),
                         static_cast<const uint16_t*>(nullptr), 0,
                         reinterpret_cast<StreamedF32*>(y), ys, m, threads);
}

// The same, called by every thread of an enclosing parallel region: this thread computes
// its share of the panels and returns (the caller synchronises before reading y).
int pdserve_gemm_packed_team(const float* x, int64_t xs, const float* wp, int64_t n, int64_t k,
                             int silu, const float* bias, const float* res, int64_t rs,
                             float* y, int64_t ys, int64_t m) {
  if (bad_args(n, k, silu, bias, res, m)) return 1;
  gemm_team(x, xs, wp, n, k, silu, bias, res, rs, y, ys, m, omp_get_thread_num(),
            omp_get_num_threads());
  return 0;
}

int pdserve_gemm_packed_bf16_team(const uint16_t* x, int64_t xs, const uint16_t* wp, int64_t n,
                                  int64_t k, int silu, const uint16_t* bias,
                                  const uint16_t* res, int64_t rs, uint16_t* y, int64_t ys,
                                  int64_t m) {
  if (bad_args(n, k, silu, bias, res, m)) return 1;
  gemm_team(x, xs, wp, n, k, silu, bias, res, rs, y, ys, m, omp_get_thread_num(),
            omp_get_num_threads());
  return 0;
}

// The build's vector width in bits (512, 256, 32); the packed layout depends on it.
int pdserve_gemm_packed_isa() { return V * 32; }

// 1 where the bf16 GEMM runs on the CPU's own bf16 dot products (avx512_bf16), else 0.
int pdserve_gemm_packed_bf16_native() { return kNativeBf16 ? 1 : 0; }

// 1 where the bf16 GEMMs of a K (a multiple of 32) run on AMX tiles, else 0.
int pdserve_gemm_packed_bf16_amx(int64_t k) { return amx_takes(k) ? 1 : 0; }

}  // extern "C"

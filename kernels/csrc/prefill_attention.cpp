// Causal prefill (extend) attention on CPU.
//
// Contract: kernels/reference.py paged_prefill_attention. q [T, H, D], k/v [Tk, Hkv, D]
// strided views (inner stride 1), out [T, H, D] row-major. Sequence b's query rows are
// q rows begins[b] .. ends[b] (sequences need not be adjacent: a step's other rows are
// left alone), at positions q_offsets[b] .. q_offsets[b] + (ends[b] - begins[b]) of its
// context, whose keys 0 .. are k/v rows kv_begins[b] .. (a fresh prompt: its own new
// rows, offset 0; a prompt with a cached prefix: its context gathered from the cache;
// kernels/prefill_attention.py). kv_begins / q_offsets may be null: begins / 0. GQA: query head
// h reads kv head h / (H / Hkv). A row's arithmetic depends only on its position and the
// keys it sees, never on which other rows are in the call: a prompt gets the same bits
// whether its prefix was cached or computed in the same step.
//
// Why not torch's flash kernel: at prompt lengths of a few hundred it runs many tiny
// GEMM calls per (sequence, head, 32-row block) and converts bf16 per call. Here one work
// item is (sequence, kv head, block of up to 128 query rows): the item's keys 0 .. last row
// are converted to fp32 once (K transposed), then every query head of the group runs
// S = Q K^T in register tiles of 4 rows x 16 keys, skipping key tiles past the causal
// edge, an exact softmax per row (whole row in memory: no online rescaling), and
// O = P V in tiles of 4 rows x D. Arithmetic fp32; bf16 only on load and final store.
// bf16 where the CPU has avx512_bf16: S = Q K^T runs on vdpbf16ps straight from the bf16
// Q and K (K laid out in key-interleaved pairs of D), 32 products an instruction where fp32
// FMAs do 16; bf16 products are exact in fp32 and accumulate in fp32, so S is what the
// fp32 path computes but for summation order (the softmax scale is applied to S, not Q).
// With D a multiple of 32, P V too: P rounded to bf16 (as torch's flash kernel does for
// bf16), V in D-interleaved key pairs, fp32 accumulation, 1 / l applied in fp32.
// Other builds (AVX2, no avx512_bf16) take the fp32 path for bf16 too.
// Items are spread over OpenMP threads dynamically (later blocks have more keys).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "exp_approx.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__)
#define PDSERVE_PREFILL_DPBF16 1
#endif

namespace {

using pdserve_cpu::load;
using pdserve_cpu::store;

constexpr int64_t kBlock = 128;  // query rows per work item (K^T built once for them)
constexpr int64_t kR = 4;        // query rows per register tile
constexpr int64_t kJ = 16;       // keys per register tile of S (4 x 16: the fastest tile)

// exp(x) for x <= 0 (exp_approx.h); below -87 it is 0 (as expf underflows).
#pragma omp declare simd notinbranch
inline float exp_le0(float x) { return x < -87.0f ? 0.0f : pdserve_cpu::exp_approx(x); }

#if defined(__AVX512F__)
// exp_le0 on 16 lanes (GCC leaves the scalar loops below unvectorized).
inline __m512 exp_le0_v(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n =
      _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.4426950408889634f), magic), magic);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(bits));
}
#endif

// Row sr of S: keys 0 .. seen - 1 become exp(s - max), keys seen .. tile_end - 1 zero
// (tile_end a multiple of kJ); returns their sum.
inline float softmax_row(float* sr, int64_t seen, int64_t tile_end) {
#if defined(__AVX512F__)
  static_assert(kJ == 16, "tile_end is a multiple of the 16 lanes");
  __m512 vm = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= seen; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sr + j));
  if (j < seen) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (seen - j)) - 1);
    vm = _mm512_mask_max_ps(vm, tail, vm, _mm512_maskz_loadu_ps(tail, sr + j));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
  __m512 l = _mm512_setzero_ps();
  for (j = 0; j < tile_end; j += 16) {
    const __mmask16 live = j + 16 <= seen ? static_cast<__mmask16>(0xffff)
                           : j < seen     ? static_cast<__mmask16>((1u << (seen - j)) - 1)
                                          : static_cast<__mmask16>(0);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_le0_v(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m)));
    l = _mm512_add_ps(l, e);
    _mm512_storeu_ps(sr + j, e);
  }
  return _mm512_reduce_add_ps(l);
#else
  float m = sr[0];
#pragma omp simd reduction(max : m)
  for (int64_t j = 1; j < seen; ++j) m = std::max(m, sr[j]);
  float l = 0.0f;
#pragma omp simd reduction(+ : l)
  for (int64_t j = 0; j < seen; ++j) {
    const float e = exp_le0(sr[j] - m);
    sr[j] = e;
    l += e;
  }
  for (int64_t j = seen; j < tile_end; ++j) sr[j] = 0.0f;
  return l;
#endif
}

struct Buffers {
  std::vector<float> kt, v, q, s;
  // vdpbf16ps operands: K in key-interleaved D pairs, Q, V in D-interleaved key pairs, P
  std::vector<uint16_t> kt2, q2, v2, p2;
  Buffers(int64_t d, int64_t max_keys, bool bf16_dot) {
    const int64_t keys = (max_keys + kJ - 1) / kJ * kJ;
    if (bf16_dot) {
      kt2.resize(d * keys);
      q2.resize(kBlock * d);
      v2.resize(keys * d);
      p2.resize(kBlock * keys);
    } else {
      kt.resize(d * keys);
      q.resize(kBlock * d);
    }
    v.resize(keys * d);
    s.resize(kBlock * keys);
  }
};

#if defined(PDSERVE_PREFILL_DPBF16)
// S[r][j] = scale * q[r] . k[j] for the kR rows from r0, keys of tiles 0 .. ntiles - 1, on
// vdpbf16ps: kt2 holds, for each pair c2 of D, the keys' (k[j][2 c2], k[j][2 c2 + 1]) side
// by side (a tile of 16 keys x one pair = 32 bf16 = one register); q2 is bf16 [rows, D],
// each row's pair broadcast as one 32-bit lane.
template <int64_t DC>
inline void scores_tile_bf16(const uint16_t* q2, const uint16_t* kt2, float* s, int64_t r0,
                             int64_t ntiles, int64_t d_rt, int64_t keys, float scale) {
  const int64_t d = DC > 0 ? DC : d_rt;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < ntiles; ++t) {
    __m512 acc[kR];
    for (int64_t r = 0; r < kR; ++r) acc[r] = _mm512_setzero_ps();
    const uint16_t* kb = kt2 + t * kJ * 2;
    for (int64_t c2 = 0; c2 < d / 2; ++c2) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + c2 * keys * 2);
      for (int64_t r = 0; r < kR; ++r) {
        int32_t pair;
        std::memcpy(&pair, q2 + (r0 + r) * d + 2 * c2, sizeof(pair));
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), kv);
      }
    }
    for (int64_t r = 0; r < kR; ++r)
      _mm512_storeu_ps(s + (r0 + r) * keys + t * kJ, _mm512_mul_ps(acc[r], vscale));
  }
}

// v2 [keys / 2][D][2]: key pair (2 j2, 2 j2 + 1) side by side for each column, from bf16
// V rows (D a multiple of 32); keys nkeys .. keys - 1 zero.
inline void interleave_v(const uint16_t* v, int64_t vs, int64_t nkeys, int64_t keys, int64_t d,
                         uint16_t* v2) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                      8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < keys; j += 2) {
    for (int64_t c = 0; c < d; c += 32) {
      const __m512i a = j < nkeys ? _mm512_loadu_si512(v + j * vs + c) : _mm512_setzero_si512();
      const __m512i b =
          j + 1 < nkeys ? _mm512_loadu_si512(v + (j + 1) * vs + c) : _mm512_setzero_si512();
      uint16_t* dst = v2 + (j / 2 * d + c) * 2;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// out rows r0 .. r0 + kR (those < rows) = P V / l over keys 0 .. nkeys - 1 on vdpbf16ps:
// p2 is P rounded to bf16 [rows, keys] (zero past each row's keys), v2 as interleave_v
// builds it; D in chunks of 64 columns (16 accumulators).
template <int64_t DC>
inline void pv_tile_bf16(const uint16_t* p2, const uint16_t* v2, const float* inv_l, int64_t r0,
                         int64_t rows, int64_t nkeys, int64_t d_rt, int64_t keys, uint16_t* o,
                         int64_t os_t) {
  const int64_t d = DC > 0 ? DC : d_rt;
  const int64_t pairs = (nkeys + 1) / 2;
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    const int64_t nb = std::min<int64_t>(4, (d - c0) / 16);  // 16-column blocks here
    __m512 acc[kR][4];
    for (int64_t r = 0; r < kR; ++r)
      for (int64_t b = 0; b < 4; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int64_t j2 = 0; j2 < pairs; ++j2) {
      const uint16_t* vj = v2 + (j2 * d + c0) * 2;
      __m512bh vv[4];
      for (int64_t b = 0; b < nb; ++b) vv[b] = (__m512bh)_mm512_loadu_si512(vj + b * 32);
      for (int64_t r = 0; r < kR; ++r) {
        int32_t pair;
        std::memcpy(&pair, p2 + (r0 + r) * keys + 2 * j2, sizeof(pair));
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
        for (int64_t b = 0; b < nb; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], pp, vv[b]);
      }
    }
    for (int64_t r = 0; r < kR && r0 + r < rows; ++r) {
      const __m512 il = _mm512_set1_ps(inv_l[r0 + r]);
      uint16_t* orow = o + (r0 + r) * os_t + c0;
      for (int64_t b = 0; b < nb; ++b)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + b * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][b], il)));
    }
  }
}
#endif

// Whether bf16 inputs take the vdpbf16ps scores (D even: whole pairs).
template <typename T>
constexpr bool bf16_dot_type() {
#if defined(PDSERVE_PREFILL_DPBF16)
  return sizeof(T) == 2;
#else
  return false;
#endif
}

// S[r][j] = q[r] . k[j] for the kR rows from r0, keys of tiles 0 .. ntiles - 1.
template <int64_t DC>
inline void scores_tile(const float* q, const float* kt, float* s, int64_t r0, int64_t ntiles,
                        int64_t d_rt, int64_t keys) {
  const int64_t d = DC > 0 ? DC : d_rt;
  for (int64_t t = 0; t < ntiles; ++t) {
    float acc[kR][kJ] = {};
    const float* ktt = kt + t * kJ;
    for (int64_t c = 0; c < d; ++c) {
      const float* kr = ktt + c * keys;
      for (int64_t r = 0; r < kR; ++r) {
        const float qv = q[(r0 + r) * d + c];
#pragma omp simd
        for (int64_t j = 0; j < kJ; ++j) acc[r][j] += qv * kr[j];
      }
    }
    for (int64_t r = 0; r < kR; ++r)
      std::memcpy(s + (r0 + r) * keys + t * kJ, acc[r], sizeof(acc[r]));
  }
}

// out rows r0 .. r0 + kR (those < rows) = P V / l over keys 0 .. nkeys - 1.
template <int64_t DC, typename T>
inline void pv_tile(const float* p, const float* v, int64_t vs, const float* inv_l, int64_t r0,
                    int64_t rows, int64_t nkeys, int64_t d_rt, int64_t keys, T* o,
                    int64_t os_t) {
  const int64_t d = DC > 0 ? DC : d_rt;
  constexpr int64_t kD = DC > 0 ? DC : 256;
  float acc[kR][kD];
  for (int64_t r = 0; r < kR; ++r)
    for (int64_t c = 0; c < d; ++c) acc[r][c] = 0.0f;
  for (int64_t j = 0; j < nkeys; ++j) {
    const float* vj = v + j * vs;
    for (int64_t r = 0; r < kR; ++r) {
      const float pr = p[(r0 + r) * keys + j];
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) acc[r][c] += pr * vj[c];
    }
  }
  for (int64_t r = 0; r < kR && r0 + r < rows; ++r) {
    T* orow = o + (r0 + r) * os_t;
    for (int64_t c = 0; c < d; ++c) store(orow + c, acc[r][c] * inv_l[r0 + r]);
  }
}

// One work item: kv head g, query positions i0 .. i1 of a sequence whose position i is
// q/out row qbase + i and whose key j is k/v row kvbase + j.
template <int64_t DC, typename T>
void attend_block(const T* q, int64_t qs_t, int64_t qs_h, const T* k, int64_t ks_t,
                  int64_t ks_h, const T* v, int64_t vs_t, int64_t vs_h, T* o, int64_t os_t,
                  int64_t qbase, int64_t kvbase, int64_t g, int64_t group, int64_t d_rt,
                  int64_t i0, int64_t i1, float scale, Buffers& buf) {
  const int64_t d = DC > 0 ? DC : d_rt;
  const int64_t nkeys = i1;  // causal: the last row sees keys 0 .. i1 - 1
  const int64_t keys = (nkeys + kJ - 1) / kJ * kJ;
  constexpr bool bf16_dot = bf16_dot_type<T>();
  const bool pv_bf16 = bf16_dot && d % 32 == 0;  // P V on vdpbf16ps too (else fp32 V)
  float* kt = buf.kt.data();
  uint16_t* kt2 = buf.kt2.data();
  float* vb = buf.v.data();
  // K^T (bf16: K in key-interleaved pairs of D) column by column: contiguous stores, the
  // item's K rows (a few KB) re-read from L1; row by row, every store hit another line.
  const T* kg = k + kvbase * ks_t + g * ks_h;
  if constexpr (bf16_dot) {
    for (int64_t c2 = 0; c2 < d / 2; ++c2) {
      uint16_t* dst = kt2 + c2 * keys * 2;
      for (int64_t j = 0; j < nkeys; ++j)
        std::memcpy(dst + 2 * j, kg + j * ks_t + 2 * c2, 2 * sizeof(uint16_t));
      std::memset(dst + 2 * nkeys, 0, (keys - nkeys) * 2 * sizeof(uint16_t));
    }
  } else {
    for (int64_t c = 0; c < d; ++c) {
      float* dst = kt + c * keys;
      for (int64_t j = 0; j < nkeys; ++j) dst[j] = load(kg + j * ks_t + c);
      for (int64_t j = nkeys; j < keys; ++j) dst[j] = 0.0f;
    }
  }
  if (!pv_bf16)
    for (int64_t j = 0; j < nkeys; ++j) {
      const T* vj = v + (kvbase + j) * vs_t + g * vs_h;
      for (int64_t c = 0; c < d; ++c) vb[j * d + c] = load(vj + c);
    }
#if defined(PDSERVE_PREFILL_DPBF16)
  uint16_t* v2 = buf.v2.data();
  uint16_t* p2 = buf.p2.data();
  if constexpr (bf16_dot) {
    if (pv_bf16) interleave_v(v + kvbase * vs_t + g * vs_h, vs_t, nkeys, keys, d, v2);
  }
#endif
  const int64_t rows = i1 - i0;
  const int64_t rows_p = (rows + kR - 1) / kR * kR;
  float* qb = buf.q.data();
  uint16_t* q2 = buf.q2.data();
  float* s = buf.s.data();
  float inv_l[kBlock];
  for (int64_t hh = 0; hh < group; ++hh) {
    const int64_t h = g * group + hh;
    for (int64_t r = 0; r < rows_p; ++r) {
      const T* qr = q + (qbase + i0 + r) * qs_t + h * qs_h;
      if constexpr (bf16_dot) {
        if (r < rows)
          std::memcpy(q2 + r * d, qr, d * sizeof(uint16_t));
        else
          std::memset(q2 + r * d, 0, d * sizeof(uint16_t));
      } else {
        for (int64_t c = 0; c < d; ++c) qb[r * d + c] = r < rows ? load(qr + c) * scale : 0.0f;
      }
    }
    for (int64_t r0 = 0; r0 < rows_p; r0 += kR) {
      const int64_t last = std::min(i0 + r0 + kR, i1);  // keys this row tile can see
#if defined(PDSERVE_PREFILL_DPBF16)
      if constexpr (bf16_dot) {
        scores_tile_bf16<DC>(q2, kt2, s, r0, (last + kJ - 1) / kJ, d, keys, scale);
        continue;
      }
#endif
      scores_tile<DC>(qb, kt, s, r0, (last + kJ - 1) / kJ, d, keys);
    }
    for (int64_t r = 0; r < rows_p; ++r) {
      float* sr = s + r * keys;
      const int64_t tile_end = std::min((i0 + (r / kR + 1) * kR + kJ - 1) / kJ * kJ, keys);
      if (r >= rows) {  // padding row: no keys
        for (int64_t j = 0; j < tile_end; ++j) sr[j] = 0.0f;
        inv_l[r] = 0.0f;
      } else {
        inv_l[r] = 1.0f / softmax_row(sr, i0 + r + 1, tile_end);
      }
#if defined(PDSERVE_PREFILL_DPBF16)
      if (pv_bf16) {  // P rounded to bf16 (as torch's flash kernel does for bf16)
        for (int64_t j = 0; j < tile_end; j += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p2 + r * keys + j),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sr + j)));
      }
#endif
    }
#if defined(PDSERVE_PREFILL_DPBF16)
    if constexpr (bf16_dot) {
      if (pv_bf16) {
        for (int64_t r0 = 0; r0 < rows_p; r0 += kR) {
          const int64_t last = std::min(i0 + r0 + kR, i1);
          pv_tile_bf16<DC>(p2, v2, inv_l, r0, rows, last, d, keys,
                           o + (qbase + i0) * os_t + h * d, os_t);
        }
        continue;
      }
    }
#endif
    for (int64_t r0 = 0; r0 < rows_p; r0 += kR) {
      const int64_t last = std::min(i0 + r0 + kR, i1);
      pv_tile<DC>(s, vb, d, inv_l, r0, rows, last, d, keys, o + (qbase + i0) * os_t + h * d,
                  os_t);
    }
  }
}

template <int64_t DC, typename T>
void run(const T* q, int64_t qs_t, int64_t qs_h, const T* k, int64_t ks_t, int64_t ks_h,
         const T* v, int64_t vs_t, int64_t vs_h, T* o, const int64_t* begins,
         const int64_t* ends, const int64_t* kv_begins, const int64_t* q_offsets, int64_t nseq,
         int64_t h, int64_t hkv, int64_t d, float scale, int threads) {
  struct Item {
    int64_t qbase, kvbase, g, i0, i1;
  };
  std::vector<Item> items;
  int64_t max_len = 0;
  for (int64_t b = 0; b < nseq; ++b) {
    const int64_t off = q_offsets ? q_offsets[b] : 0;
    const int64_t len = off + ends[b] - begins[b];  // context length: keys the last row sees
    const int64_t kvb = kv_begins ? kv_begins[b] : begins[b];
    max_len = std::max(max_len, len);
    for (int64_t i0 = off; i0 < len; i0 += kBlock)
      for (int64_t g = 0; g < hkv; ++g)
        items.push_back({begins[b] - off, kvb, g, i0, std::min(i0 + kBlock, len)});
  }
  // heaviest (most keys) first, so the dynamic schedule ends balanced
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.i1 > b.i1; });
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t group = h / hkv;
  const int64_t os_t = h * d;
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 1)
  {
    Buffers buf(d, max_len, bf16_dot_type<T>());
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const Item& it = items[i];
      attend_block<DC>(q, qs_t, qs_h, k, ks_t, ks_h, v, vs_t, vs_h, o, os_t, it.qbase,
                       it.kvbase, it.g, group, d, it.i0, it.i1, scale, buf);
    }
  }
}

template <typename T>
int dispatch(const void* q, int64_t qs_t, int64_t qs_h, const void* k, int64_t ks_t,
             int64_t ks_h, const void* v, int64_t vs_t, int64_t vs_h, void* o,
             const int64_t* begins, const int64_t* ends, const int64_t* kv_begins,
             const int64_t* q_offsets, int64_t nseq, int64_t h, int64_t hkv, int64_t d, float scale,
             int threads) {
  const T* qp = static_cast<const T*>(q);
  const T* kp = static_cast<const T*>(k);
  const T* vp = static_cast<const T*>(v);
  T* op = static_cast<T*>(o);
  if (d == 64) {
    run<64>(qp, qs_t, qs_h, kp, ks_t, ks_h, vp, vs_t, vs_h, op, begins, ends, kv_begins, q_offsets, nseq, h, hkv, d, scale,
            threads);
  } else if (d == 128) {
    run<128>(qp, qs_t, qs_h, kp, ks_t, ks_h, vp, vs_t, vs_h, op, begins, ends, kv_begins, q_offsets, nseq, h, hkv, d, scale,
             threads);
  } else if (d <= 256) {
    run<0>(qp, qs_t, qs_h, kp, ks_t, ks_h, vp, vs_t, vs_h, op, begins, ends, kv_begins, q_offsets, nseq, h, hkv, d, scale,
           threads);
  } else {
    return 1;
  }
  return 0;
}

}  // namespace

extern "C" {

// Strides in elements. dtype 0 = fp32, 1 = bf16. Returns 0, or 1 for an unsupported shape
// (head dim odd or over 256, or H not a multiple of Hkv).
int pdserve_prefill_attention(const void* q, int64_t qs_t, int64_t qs_h, const void* k,
                              int64_t ks_t, int64_t ks_h, const void* v, int64_t vs_t,
                              int64_t vs_h, void* out, const int64_t* begins,
                              const int64_t* ends, const int64_t* kv_begins,
                              const int64_t* q_offsets, int64_t nseq,
                              int64_t h, int64_t hkv, int64_t d, float scale, int dtype,
                              int threads) {
  if (hkv <= 0 || h % hkv != 0 || d % 2 != 0) return 1;
  if (dtype == 0)
    return dispatch<float>(q, qs_t, qs_h, k, ks_t, ks_h, v, vs_t, vs_h, out, begins, ends, kv_begins, q_offsets, nseq, h,
                           hkv, d, scale, threads);
  return dispatch<uint16_t>(q, qs_t, qs_h, k, ks_t, ks_h, v, vs_t, vs_h, out, begins, ends, kv_begins, q_offsets, nseq, h,
                            hkv, d, scale, threads);
}

}  // extern "C"

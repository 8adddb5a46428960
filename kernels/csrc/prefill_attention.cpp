// Causal attention of fresh prompts (no cached prefix) over their own K/V, on CPU.
//
// Contract: kernels/reference.py paged_prefill_attention for sequences whose query chunk
// is the whole sequence (q_len == seq_len), with K/V read from this step's rows instead
// of the cache (kernels/cpu_prefill.py decides when that holds). q [T, H, D], k/v
// [T, Hkv, D] strided views (inner stride 1), out [T, H, D] row-major; sequence b is rows
// begins[b] .. ends[b] (sequences need not be adjacent: a step's other rows are left
// alone); GQA: query head h reads kv head h / (H / Hkv).
//
// Why not torch's flash kernel: at prompt lengths of a few hundred it runs many tiny
// GEMM calls per (sequence, head, 32-row block) and converts bf16 per call. Here one work
// item is (sequence, kv head, block of up to 128 query rows): the item's keys 0 .. last row
// are converted to fp32 once (K transposed), then every query head of the group runs
// S = Q K^T in register tiles of 4 rows x 16 keys, skipping key tiles past the causal
// edge, an exact softmax per row (whole row in memory: no online rescaling), and
// O = P V in tiles of 4 rows x D. Arithmetic fp32; bf16 only on load and final store.
// Items are spread over OpenMP threads dynamically (later blocks have more keys).

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

namespace {

using pdserve_cpu::load;
using pdserve_cpu::store;

constexpr int64_t kBlock = 128;  // query rows per work item (K^T built once for them)
constexpr int64_t kR = 4;        // query rows per register tile
constexpr int64_t kJ = 16;       // keys per register tile of S (4 x 16 measured best)

// exp(x) for x <= 0: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, degree-7 Taylor
// polynomial (relative error ~1e-7); below -87 it is 0 (as expf underflows).
#pragma omp declare simd notinbranch
inline float exp_le0(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23
  const float n = (xc * 1.4426950408889634f + magic) - magic;
  float r = xc - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

struct Buffers {
  std::vector<float> kt, v, q, s;
  Buffers(int64_t d, int64_t max_keys) {
    const int64_t keys = (max_keys + kJ - 1) / kJ * kJ;
    kt.resize(d * keys);
    v.resize(keys * d);
    q.resize(kBlock * d);
    s.resize(kBlock * keys);
  }
};

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

// One work item: sequence rows [base, base + len), kv head g, query rows i0 .. i1.
template <int64_t DC, typename T>
void attend_block(const T* q, int64_t qs_t, int64_t qs_h, const T* k, int64_t ks_t,
                  int64_t ks_h, const T* v, int64_t vs_t, int64_t vs_h, T* o, int64_t os_t,
                  int64_t base, int64_t g, int64_t group, int64_t d_rt, int64_t i0,
                  int64_t i1, float scale, Buffers& buf) {
  const int64_t d = DC > 0 ? DC : d_rt;
  const int64_t nkeys = i1;  // causal: the last row sees keys 0 .. i1 - 1
  const int64_t keys = (nkeys + kJ - 1) / kJ * kJ;
  float* kt = buf.kt.data();
  float* vb = buf.v.data();
  for (int64_t j = 0; j < keys; ++j) {
    if (j < nkeys) {
      const T* kj = k + (base + j) * ks_t + g * ks_h;
      const T* vj = v + (base + j) * vs_t + g * vs_h;
      for (int64_t c = 0; c < d; ++c) kt[c * keys + j] = load(kj + c);
      for (int64_t c = 0; c < d; ++c) vb[j * d + c] = load(vj + c);
    } else {
      for (int64_t c = 0; c < d; ++c) kt[c * keys + j] = 0.0f;
    }
  }
  const int64_t rows = i1 - i0;
  const int64_t rows_p = (rows + kR - 1) / kR * kR;
  float* qb = buf.q.data();
  float* s = buf.s.data();
  float inv_l[kBlock];
  for (int64_t hh = 0; hh < group; ++hh) {
    const int64_t h = g * group + hh;
    for (int64_t r = 0; r < rows_p; ++r) {
      const T* qr = q + (base + i0 + r) * qs_t + h * qs_h;
      for (int64_t c = 0; c < d; ++c) qb[r * d + c] = r < rows ? load(qr + c) * scale : 0.0f;
    }
    for (int64_t r0 = 0; r0 < rows_p; r0 += kR) {
      const int64_t last = std::min(i0 + r0 + kR, i1);  // keys this row tile can see
      scores_tile<DC>(qb, kt, s, r0, (last + kJ - 1) / kJ, d, keys);
    }
    for (int64_t r = 0; r < rows_p; ++r) {
      float* sr = s + r * keys;
      const int64_t tile_end = std::min((i0 + (r / kR + 1) * kR + kJ - 1) / kJ * kJ, keys);
      if (r >= rows) {  // padding row: no keys
        for (int64_t j = 0; j < tile_end; ++j) sr[j] = 0.0f;
        inv_l[r] = 0.0f;
        continue;
      }
      const int64_t seen = i0 + r + 1;
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
      inv_l[r] = 1.0f / l;
    }
    for (int64_t r0 = 0; r0 < rows_p; r0 += kR) {
      const int64_t last = std::min(i0 + r0 + kR, i1);
      pv_tile<DC>(s, vb, d, inv_l, r0, rows, last, d, keys, o + (base + i0) * os_t + h * d,
                  os_t);
    }
  }
}

template <int64_t DC, typename T>
void run(const T* q, int64_t qs_t, int64_t qs_h, const T* k, int64_t ks_t, int64_t ks_h,
         const T* v, int64_t vs_t, int64_t vs_h, T* o, const int64_t* begins, const int64_t* ends, int64_t nseq,
         int64_t h, int64_t hkv, int64_t d, float scale, int threads) {
  struct Item {
    int64_t base, g, i0, i1;
  };
  std::vector<Item> items;
  int64_t max_len = 0;
  for (int64_t b = 0; b < nseq; ++b) {
    const int64_t len = ends[b] - begins[b];
    max_len = std::max(max_len, len);
    for (int64_t i0 = 0; i0 < len; i0 += kBlock)
      for (int64_t g = 0; g < hkv; ++g)
        items.push_back({begins[b], g, i0, std::min(i0 + kBlock, len)});
  }
  // heaviest (most keys) first, so the dynamic schedule ends balanced
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.i1 > b.i1; });
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t group = h / hkv;
  const int64_t os_t = h * d;
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 1)
  {
    Buffers buf(d, max_len);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const Item& it = items[i];
      attend_block<DC>(q, qs_t, qs_h, k, ks_t, ks_h, v, vs_t, vs_h, o, os_t, it.base, it.g,
                       group, d, it.i0, it.i1, scale, buf);
    }
  }
}

template <typename T>
int dispatch(const void* q, int64_t qs_t, int64_t qs_h, const void* k, int64_t ks_t,
             int64_t ks_h, const void* v, int64_t vs_t, int64_t vs_h, void* o,
             const int64_t* begins, const int64_t* ends, int64_t nseq, int64_t h, int64_t hkv, int64_t d, float scale,
             int threads) {
  const T* qp = static_cast<const T*>(q);
  const T* kp = static_cast<const T*>(k);
  const T* vp = static_cast<const T*>(v);
  T* op = static_cast<T*>(o);
  if (d == 64) {
    run<64>(qp, qs_t, qs_h, kp, ks_t, ks_h, vp, vs_t, vs_h, op, begins, ends, nseq, h, hkv, d, scale,
            threads);
  } else if (d == 128) {
    run<128>(qp, qs_t, qs_h, kp, ks_t, ks_h, vp, vs_t, vs_h, op, begins, ends, nseq, h, hkv, d, scale,
             threads);
  } else if (d <= 256) {
    run<0>(qp, qs_t, qs_h, kp, ks_t, ks_h, vp, vs_t, vs_h, op, begins, ends, nseq, h, hkv, d, scale,
           threads);
  } else {
    return 1;
  }
  return 0;
}

}  // namespace

extern "C" {

// Strides in elements. dtype 0 = fp32, 1 = bf16. Returns 0, or 1 for an unsupported shape
// (head dim over 256, or H not a multiple of Hkv).
int pdserve_prefill_attention(const void* q, int64_t qs_t, int64_t qs_h, const void* k,
                              int64_t ks_t, int64_t ks_h, const void* v, int64_t vs_t,
                              int64_t vs_h, void* out, const int64_t* begins, const int64_t* ends, int64_t nseq,
                              int64_t h, int64_t hkv, int64_t d, float scale, int dtype,
                              int threads) {
  if (hkv <= 0 || h % hkv != 0) return 1;
  if (dtype == 0)
    return dispatch<float>(q, qs_t, qs_h, k, ks_t, ks_h, v, vs_t, vs_h, out, begins, ends, nseq, h,
                           hkv, d, scale, threads);
  return dispatch<uint16_t>(q, qs_t, qs_h, k, ks_t, ks_h, v, vs_t, vs_h, out, begins, ends, nseq, h,
                            hkv, d, scale, threads);
}

}  // extern "C"

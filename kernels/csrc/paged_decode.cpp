// Paged decode attention on CPU, reading the KV blocks in place (no gather).
//
// Contract: kernels/reference.py `paged_decode_attention`. One query token per sequence;
// caches [num_blocks, block_size, num_kv_heads, head_dim], each block's [block_size,
// num_kv_heads, head_dim] contiguous, blocks `block_stride` elements apart (K and V alike:
// bs * Hkv * D for a layer-major cache, 2 * L times that for block-major); block tables int32
// [B, M]; context_lens int32 [B]. Grouped-query attention: the G = H / Hkv query heads of
// one kv head share each K/V row read. fp32 or bf16 storage, fp32 arithmetic.
//
// Work item = (sequence, kv head, key split). A split computes its G heads' scores over its
// keys, their max m and sum l of exp(s - m), and acc = sum exp(s - m) v; long contexts
// with few sequences are cut into several splits so both cores have work, and the splits
// are then merged (flash-decoding). Plain C++ with OpenMP: auto-vectorized by the compiler
// (-O3 -march=native), exp by range reduction + polynomial so it vectorizes too.
// Called through ctypes (kernels/cpu_attention.py): no torch headers, builds in ~1 s.

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

namespace {

using pdserve_cpu::bf16_to_float;
using pdserve_cpu::float_to_bf16;
using pdserve_cpu::load;
using pdserve_cpu::store;

// exp(x) for x <= 0 (scores minus their max): 2^i * 2^f with f in [-0.5, 0.5], degree-7
// Taylor polynomial in f*ln2 (relative error < 1e-7), vectorizable (no libm call).
#pragma omp declare simd notinbranch
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.4426950408889634f;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float fi = (t + magic) - magic;
  const float r = (t - fi) * 0.6931471805599453f;  // |r| <= ln2 / 2
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Touch the next block's first row while this block is read: blocks sit anywhere in the
// cache (block-major: 2 * layers blocks apart), so its page translation and first lines
// are fetched early. Measured: 3-4 % less CPU per call on either layout, and a strided
// (block-major) cache as fast as a contiguous one (docs/benchmarks.md).
inline void prefetch_block(const void* p) { __builtin_prefetch(p); }

struct Args {
  const void* q;
  const void* k;
  const void* v;
  const int32_t* block_tables;
  const int32_t* context_lens;
  void* out;
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_stride_seq, q_stride_head;  // elements; head_dim is contiguous
  int64_t block_stride;                 // elements from one KV block to the next
  int64_t split_keys;                   // keys per split (a multiple of block_size)
  int64_t num_splits;                   // splits per (sequence, kv head)
  float scale;
};

// One split: scores, max, sum and un-normalized output of G heads over keys [t0, t1).
// DC is the head dim when known at compile time (the common 64 and 128: fully unrolled
// row loops), else 0 (read from the arguments).
template <typename T, int DC>
void run_split(const Args& a, int64_t b, int64_t kvh, int64_t t0, int64_t t1, float* m_out,
               float* l_out, float* acc, std::vector<float>& qf, std::vector<float>& s) {
  const int64_t D = DC ? DC : a.head_dim, G = a.num_heads / a.num_kv_heads, n = t1 - t0;
  const int64_t bs = a.block_size, row = a.num_kv_heads * D, blk = a.block_stride;
  const T* q = static_cast<const T*>(a.q);
  const T* kc = static_cast<const T*>(a.k);
  const T* vc = static_cast<const T*>(a.v);
  const int32_t* table = a.block_tables + b * a.max_blocks;
  qf.resize(G * D);
  s.resize(G * n);
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + b * a.q_stride_seq + (kvh * G + g) * a.q_stride_head;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(qg + d) * a.scale;
  }
  const float* qp = qf.data();
  for (int64_t t = t0; t < t1; ++t) {
    const T* kr = kc + table[t / bs] * blk + (t % bs) * row + kvh * D;
    if (t % bs == 0 && t + bs < t1) prefetch_block(kc + table[t / bs + 1] * blk + kvh * D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qp + g * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * load(kr + d);
      s[g * n + (t - t0)] = dot;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s.data() + g * n;
    float m = sg[0];
    for (int64_t i = 1; i < n; ++i) m = sg[i] > m ? sg[i] : m;
    float l = 0.0f;
#pragma omp simd reduction(+ : l)
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = exp_nonpos(sg[i] - m);
      l += sg[i];
    }
    m_out[g] = m;
    l_out[g] = l;
  }
  std::memset(acc, 0, sizeof(float) * G * D);
  for (int64_t t = t0; t < t1; ++t) {
    const T* vr = vc + table[t / bs] * blk + (t % bs) * row + kvh * D;
    if (t % bs == 0 && t + bs < t1) prefetch_block(vc + table[t / bs + 1] * blk + kvh * D);
    for (int64_t g = 0; g < G; ++g) {
      const float p = s[g * n + (t - t0)];
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * load(vr + d);
    }
  }
}

// Merges the S splits of every (sequence, kv head) into the output. Called inside the
// parallel region: the team shares the loop.
template <typename T>
void merge_splits(const Args& a, const float* part, T* out) {
  const int64_t Hkv = a.num_kv_heads, D = a.head_dim;
  const int64_t G = a.num_heads / Hkv, S = a.num_splits;
#pragma omp for schedule(static)
  for (int64_t bh = 0; bh < a.num_seqs * Hkv; ++bh) {
    const int64_t b = bh / Hkv, kvh = bh % Hkv;
    for (int64_t g = 0; g < G; ++g) {
      float mx = -INFINITY;
      for (int64_t sp = 0; sp < S; ++sp) {
        const float* p = part + (bh * S + sp) * G * (D + 2);
        if (p[G + g] > 0.0f && p[g] > mx) mx = p[g];
      }
      float o[1024];  // head_dim <= 1024 (checked by the caller)
      float l = 0.0f;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
      for (int64_t sp = 0; sp < S; ++sp) {
        const float* p = part + (bh * S + sp) * G * (D + 2);
        if (!(p[G + g] > 0.0f)) continue;  // an empty split
        const float w = std::exp(p[g] - mx);
        l += w * p[G + g];
        const float* acc = p + 2 * G + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      T* dst = out + (b * a.num_heads + kvh * G + g) * D;
      for (int64_t d = 0; d < D; ++d) store(dst + d, o[d] * inv);
    }
  }
}

template <typename T>
void decode(const Args& a, int num_threads) {
  const int64_t B = a.num_seqs, Hkv = a.num_kv_heads, D = a.head_dim;
  const int64_t G = a.num_heads / Hkv, S = a.num_splits;
  T* out = static_cast<T*>(a.out);  // [B, H, D] contiguous
  // Per split: m[G], l[G], acc[G * D]. One split per item is written out at once (one
  // barrier per call: a busy 2-core box deschedules threads, every barrier costs).
  std::vector<float> part(static_cast<size_t>(B * Hkv * S * G * (D + 2)));
  const int64_t items = B * Hkv * S;
  auto split_fn = D == 64 ? run_split<T, 64> : D == 128 ? run_split<T, 128> : run_split<T, 0>;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> qf, s;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t it = 0; it < items; ++it) {
      const int64_t b = it / (Hkv * S), kvh = (it / S) % Hkv, sp = it % S;
      const int64_t len = a.context_lens[b];
      const int64_t t0 = sp * a.split_keys;
      const int64_t t1 = t0 + a.split_keys < len ? t0 + a.split_keys : len;
      float* m = part.data() + it * G * (D + 2);
      float* l = m + G;
      float* acc = l + G;
      if (t0 >= t1) {  // an empty split (a shorter sequence) contributes nothing
        for (int64_t g = 0; g < G; ++g) l[g] = 0.0f, m[g] = -INFINITY;
        if (S == 1) {  // a sequence without context: zeros
          T* dst = out + (b * a.num_heads + kvh * G) * D;
          for (int64_t x = 0; x < G * D; ++x) store(dst + x, 0.0f);
        }
        continue;
      }
      split_fn(a, b, kvh, t0, t1, m, l, acc, qf, s);
      if (S == 1) {  // the only split: normalize and write the output now
        for (int64_t g = 0; g < G; ++g) {
          const float inv = 1.0f / l[g];
          T* dst = out + (b * a.num_heads + kvh * G + g) * D;
          for (int64_t d = 0; d < D; ++d) store(dst + d, acc[g * D + d] * inv);
        }
      }
    }
    if (S > 1) {
#pragma omp barrier
      merge_splits<T>(a, part.data(), out);
    }
  }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. Returns 0, or -1 on an unsupported argument.
int pdserve_paged_decode(const void* q, const void* k_cache, const void* v_cache,
                         const int32_t* block_tables, const int32_t* context_lens, void* out,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t max_blocks,
                         int64_t q_stride_seq, int64_t q_stride_head, int64_t block_stride,
                         int64_t split_keys, int64_t num_splits, float scale, int dtype,
                         int num_threads) {
  if (head_dim > 1024 || num_kv_heads <= 0 || num_heads % num_kv_heads || split_keys <= 0 ||
      num_splits <= 0 || num_threads <= 0 || block_stride < block_size * num_kv_heads * head_dim)
    return -1;
  Args a{q,            k_cache,      v_cache,      block_tables, context_lens,
         out,          num_seqs,     num_heads,    num_kv_heads, head_dim,
         block_size,   max_blocks,   q_stride_seq, q_stride_head, block_stride,
         split_keys,   num_splits,   scale};
  if (dtype == 0) {
    decode<float>(a, num_threads);
  } else if (dtype == 1) {
    decode<uint16_t>(a, num_threads);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"

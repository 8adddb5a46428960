// Paged decode attention on CPU, reading the KV blocks in place (no gather).
//
// Contract: kernels/reference.py `paged_decode_attention`. One query token per sequence;
// caches [num_blocks, block_size, num_kv_heads, head_dim], each block's [block_size,
// num_kv_heads, head_dim] contiguous, blocks `block_stride` elements apart (K and V alike:
// bs * Hkv * D for a layer-major cache, 2 * L times that for block-major); block tables int32
// [B, M]; context_lens int32 [B]. Grouped-query attention: the G = H / Hkv query heads of
// one kv head share each K/V row read. fp32 or bf16 storage, fp32 arithmetic. head_dim a
// multiple of 16, at most 256 (the caller checks; other shapes go to the reference).
//
// Work item = (sequence, key split), all heads. A split computes every head's scores over
// its keys, their max m and sum l of exp(s - m), and acc = sum exp(s - m) v; long contexts
// with few sequences are cut into several splits so both cores have work, and the splits
// are then merged (flash-decoding).
//
// Vectors are GCC vector extensions (16 floats with AVX-512, 8 with AVX2). Scores: W keys
// at a time, each K row read once (all kv heads) and converted once, one vector of partial
// sums per (head, key), reduced W at a time by shuffles (no horizontal sum per key); bf16
// with avx512_bf16 runs the dot products on vdpbf16ps straight from the cache. Output:
// the accumulators of a chunk of heads stay in registers over the keys. Row offsets are
// computed once per split (one division per block, not per key). This replaced a
// per-(sequence, kv head) scalar-loop kernel (figures: docs/benchmarks-history.md, "bf16
// decode step").
// exp by range reduction + polynomial so it vectorizes too. Called through ctypes
// (kernels/paged_decode.py): no torch headers.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "paged_decode_vec.h"

namespace {

using pdserve_cpu::load;
using pdserve_cpu::store;

using namespace pdserve_decode_vec;  // W, vf, loadv, exp_nonpos, ... (paged_decode_vec.h)

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
  int64_t split_keys;                   // keys per split
  int64_t num_splits;                   // splits per sequence
  float scale;
};

// The item a thread computes next (one thread running the items in order: the batched
// decode forward's threads each run their own rows so): while this item computes, its K
// (during the scores) and V (during the first output pass) stream into L2, spread over the
// item's work, so the DRAM reads overlap compute instead of stalling each key group (a
// split reads ~286 KB for 191 keys of SmolLM2, mostly too few keys ahead for the
// per-key prefetches below to hide).
struct Next {
  const int32_t* table = nullptr;  // null: none
  int64_t blk0 = 0, blocks = 0;    // its blocks table[blk0 .. blk0 + blocks)
  int64_t lines = 0;               // 64-byte lines a block's keys hold (K or V)
  int64_t block_bytes = 0;         // bytes from one block to the next (block_stride)
  int64_t total() const { return blocks * lines; }
};

// Prefetches one of the next item's planes (K or V) into L2 at a steady rate: `tick()`
// once per unit of the current work issues on average total / ticks lines, in order. A
// burst of prefetches overflows the miss queues and most are dropped: the same lines
// issued a head's share at a time gain nothing.
struct Stream {
  const char* base = nullptr;
  Next nx;  // a copy: the caller's may be a temporary
  const char* at = nullptr;
  bool on = false;
  int64_t blk = 0, ln = 0, num = 0, den = 1, acc = 0;
  Stream(const void* plane, const Next& next, int64_t ticks) : nx(next) {
    if (next.table == nullptr || ticks <= 0) return;
    on = true;
    base = static_cast<const char*>(plane);
    at = base + nx.table[nx.blk0] * nx.block_bytes;
    num = nx.total();
    den = ticks;
  }
  inline void tick() {
    for (acc += num; acc >= den; acc -= den) {
      if (blk >= nx.blocks) return;
      __builtin_prefetch(at + ln * 64, 0, 2);
      if (++ln == nx.lines) {
        ln = 0;
        if (++blk < nx.blocks) at = base + nx.table[nx.blk0 + blk] * nx.block_bytes;
      }
    }
  }
};

// W vectors of partial sums (one per key) -> one vector of the W sums, in key order: levels
// of pairwise shuffles and adds (3 operations per level and pair: 45 for 16 dot products,
// where a horizontal sum per dot product costs ~8 dependent ones).
#if defined(__AVX512F__)
inline vf reduce_keys(const vf* a) {
  vf l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: key 2i, 8-15: key 2i + 1 (8 partial sums each)
    l1[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                    19, 20, 21, 22, 23) +
            __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                    26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // 128-bit chunk c: key 4i + c (4 partial sums)
    l2[i] = __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                    18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                    22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // chunk c: key 8i + c (2 lanes), key 8i + 4 + c (2 lanes)
    l3[i] = __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                    24, 25, 12, 13, 28, 29) +
            __builtin_shufflevector(l2[2 * i], l2[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                    26, 27, 14, 15, 30, 31);
  // chunk c: keys c, 4 + c, 8 + c, 12 + c
  const vf r = __builtin_shufflevector(l3[0], l3[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26,
                                       12, 14, 28, 30) +
               __builtin_shufflevector(l3[0], l3[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27,
                                       13, 15, 29, 31);
  return __builtin_shufflevector(r, r, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}
#else
inline vf reduce_keys(const vf* a) {
  vf l1[4], l2[2];
  for (int i = 0; i < 4; ++i)  // lanes 0-3: key 2i, 4-7: key 2i + 1 (4 partial sums each)
    l1[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
            __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // keys 4i, 4i + 2, 4i + 1, 4i + 3 (2 lanes each)
    l2[i] = __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
            __builtin_shufflevector(l1[2 * i], l1[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  // keys 0, 2, 4, 6, 1, 3, 5, 7
  const vf r = __builtin_shufflevector(l2[0], l2[1], 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(l2[0], l2[1], 1, 3, 9, 11, 5, 7, 13, 15);
  return __builtin_shufflevector(r, r, 0, 4, 1, 5, 2, 6, 3, 7);
}
#endif

// q . k over D = NV * W elements, as a vector of W partial sums. qf: q in fp32; qr: q as
// stored. bf16 on a CPU with the bf16 pairs instruction: the dot products run on it (the
// product of two bf16 is exact in fp32, only the summation order differs).
template <int NV>
inline vf dot_partial(const vf* qf, const vf*, const vf* k) {  // K already in fp32
  vf acc = qf[0] * k[0];
  for (int v = 1; v < NV; ++v) acc += qf[v] * k[v];
  return acc;
}

template <int NV>
inline vf dot_partial(const vf* qf, const float*, const float* k) {
  vf acc = qf[0] * loadv(k);
  for (int v = 1; v < NV; ++v) acc += qf[v] * loadv(k + W * v);
  return acc;
}

template <int NV>
inline vf dot_partial(const vf* qf, const uint16_t* qr, const uint16_t* k) {
#if defined(__AVX512BF16__)
  (void)qf;
  __m512 acc = _mm512_setzero_ps();
  for (int v = 0; v + 1 < NV; v += 2)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qr + W * v),
                           (__m512bh)_mm512_loadu_si512(k + W * v));
  if (NV % 2) {
    const __m256 half = _mm256_dpbf16_ps(
        _mm256_setzero_ps(), (__m256bh)_mm256_loadu_si256((const __m256i*)(qr + W * (NV - 1))),
        (__m256bh)_mm256_loadu_si256((const __m256i*)(k + W * (NV - 1))));
    acc = _mm512_add_ps(acc, _mm512_insertf32x8(_mm512_setzero_ps(), half, 0));
  }
  vf r;
  std::memcpy(&r, &acc, sizeof(r));
  return r;
#else
  (void)qr;
  vf acc = qf[0] * loadv(k);
  for (int v = 1; v < NV; ++v) acc += qf[v] * loadv(k + W * v);
  return acc;
#endif
}

// acc[g] = sum over keys of p[g][t] * v[t] for GC heads h0.. of kv head kvh, in registers.
// rows[t - t0]: the key's row offset in the cache (block * block_stride + slot * row).
template <typename T, int NV, int GC>
void pv_chunk(const Args& a, const int64_t* rows, int64_t kvh, int64_t h0, int64_t n,
              const float* s, float* acc_out, const Next& nx) {
  const T* vc = static_cast<const T*>(a.v) + kvh * NV * W;
  vf acc[GC][NV] = {};
  // The first pass over V (kv head 0's first chunk) fetches whole rows ahead for all the
  // passes, so the later passes find V in L2 (less attention time in a real B step).
  const bool fetch = kvh == 0 && h0 == 0;
  const int64_t row_lines = (a.num_kv_heads * NV * W * sizeof(T) + 63) / 64;
  Stream next(a.v, fetch ? nx : Next{}, n);  // the next item's V over this first pass
  for (int64_t i = 0; i < n; ++i) {
    if (fetch && i + kPrefetchKeys < n)
      for (int64_t l = 0; l < row_lines; ++l)
        __builtin_prefetch(static_cast<const T*>(a.v) + rows[i + kPrefetchKeys] + l * 64 / sizeof(T));
    if (next.on) next.tick();
    const T* vr = vc + rows[i];
    vf x[NV];
    for (int v = 0; v < NV; ++v) x[v] = loadv(vr + v * W);
    for (int g = 0; g < GC; ++g) {
      const float p = s[(h0 + g) * n + i];
      for (int v = 0; v < NV; ++v) acc[g][v] += p * x[v];
    }
  }
  for (int g = 0; g < GC; ++g) std::memcpy(acc_out + (h0 + g) * NV * W, acc[g], sizeof(acc[g]));
}

template <typename T, int NV>
void pv_heads(const Args& a, const int64_t* rows, int64_t kvh, int64_t h0, int64_t count,
              int64_t n, const float* s, float* acc, const Next& nx) {
  // as many heads a pass as their accumulators fit registers: each pass reads (and, bf16,
  // converts) the V rows again, so a group of 3 heads (SmolLM2) is one pass, not 2 + 1
  constexpr int kMax = std::clamp(kAccVectors / NV, 1, 4);
  for (; count >= kMax; count -= kMax, h0 += kMax)
    pv_chunk<T, NV, kMax>(a, rows, kvh, h0, n, s, acc, nx);
  if constexpr (kMax == 4) {
    if (count == 3) {
      pv_chunk<T, NV, 3>(a, rows, kvh, h0, n, s, acc, nx);
      return;
    }
  }
  for (; count >= 2; count -= 2, h0 += 2) pv_chunk<T, NV, 2>(a, rows, kvh, h0, n, s, acc, nx);
  if (count == 1) pv_chunk<T, NV, 1>(a, rows, kvh, h0, n, s, acc, nx);
}

// bf16 K without the bf16 pairs instruction: a group's rows are converted to fp32 once.
#if defined(__AVX512BF16__)
template <typename T>
constexpr bool kConvertK = false;
#else
template <typename T>
constexpr bool kConvertK = std::is_same_v<T, uint16_t>;
#endif

// Per-thread scratch of a split: q in fp32, scores [H, n], row offsets [n], and (see
// kConvertK) a group of K rows in fp32.
struct Scratch {
  std::vector<vf> qf, kf;
  std::vector<float> s;
  std::vector<int64_t> rows;
};

// One split of sequence b over keys [t0, t1): per head h, m[h], l[h] and the
// un-normalized acc[h * D ...].
template <typename T, int NV>
void run_split(const Args& a, int64_t b, int64_t t0, int64_t t1, float* m, float* l,
               float* acc, Scratch& w, const Next& nx) {
  constexpr int64_t D = NV * W;
  const int64_t H = a.num_heads, Hkv = a.num_kv_heads, G = H / Hkv, n = t1 - t0;
  const int64_t bs = a.block_size, row = Hkv * D;
  const T* q = static_cast<const T*>(a.q) + b * a.q_stride_seq;
  const T* kc = static_cast<const T*>(a.k);
  const int32_t* table = a.block_tables + b * a.max_blocks;
  w.qf.resize(H * NV);
  w.s.resize(H * n);
  w.rows.resize(n + W);
  if constexpr (kConvertK<T>) w.kf.resize(W * Hkv * NV);
  for (int64_t h = 0; h < H; ++h)
    for (int v = 0; v < NV; ++v) w.qf[h * NV + v] = loadv(q + h * a.q_stride_head + v * W);
  int64_t* rows = w.rows.data();
  for (int64_t t = t0; t < t1;) {  // each key's row offset: one division per block
    const int64_t blk = t / bs, end = (blk + 1) * bs < t1 ? (blk + 1) * bs : t1;
    const int64_t base = table[blk] * a.block_stride;
    for (int64_t j = t - blk * bs; t < end; ++t, ++j) rows[t - t0] = base + j * row;
  }
  for (int64_t i = n; i < n + W; ++i) rows[i] = rows[0];  // pads a last partial group
  const int64_t row_lines = (row * sizeof(T) + 63) / 64;
  float* sp = w.s.data();
  // Scores, W keys at a time: each K row read once (all kv heads), one reduction per
  // (head, W keys).
  Stream next(kc, nx, (n + W - 1) / W * H);  // the next item's K over the scores: a tick a head
  for (int64_t i0 = 0; i0 < n; i0 += W) {
    for (int64_t i = i0 + kPrefetchKeys; i < i0 + kPrefetchKeys + W && i < n; ++i)
      for (int64_t ln = 0; ln < row_lines; ++ln)
        __builtin_prefetch(kc + rows[i] + ln * 64 / sizeof(T));
    const int64_t cnt = n - i0 < W ? n - i0 : W;
    if constexpr (kConvertK<T>) {  // the group's K rows to fp32 once, not once per head
      for (int i = 0; i < W; ++i)
        for (int64_t v = 0; v < Hkv * NV; ++v)
          w.kf[i * Hkv * NV + v] = loadv(kc + rows[i0 + i] + v * W);
    }
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        if (next.on) next.tick();
        const vf* qfh = w.qf.data() + h * NV;
        const T* qr = q + h * a.q_stride_head;
        vf part[W];
        for (int i = 0; i < W; ++i) {
          if constexpr (kConvertK<T>)
            part[i] = dot_partial<NV>(qfh, qfh, w.kf.data() + (i * Hkv + kvh) * NV);
          else
            part[i] = dot_partial<NV>(qfh, qr, kc + rows[i0 + i] + kvh * D);
        }
        const vf sc = reduce_keys(part) * a.scale;
        std::memcpy(sp + h * n + i0, &sc, cnt * sizeof(float));
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* sh = sp + h * n;
    float mx = sh[0];
#pragma omp simd reduction(max : mx)
    for (int64_t i = 1; i < n; ++i) mx = sh[i] > mx ? sh[i] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sh[i] = exp_nonpos(sh[i] - mx);
      sum += sh[i];
    }
    m[h] = mx;
    l[h] = sum;
  }
  for (int64_t kvh = 0; kvh < Hkv; ++kvh)
    pv_heads<T, NV>(a, rows, kvh, kvh * G, G, n, sp, acc, nx);
}

// Merges the S splits of every sequence into the output. Called inside the parallel
// region: the team shares the loop. part: per (sequence, split) m[H], l[H], acc[H * D].
template <typename T>
void merge_splits(const Args& a, const float* part, T* out) {
  const int64_t H = a.num_heads, D = a.head_dim, S = a.num_splits, item = H * (D + 2);
#pragma omp for schedule(static)
  for (int64_t bh = 0; bh < a.num_seqs * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    float mx = -INFINITY;
    for (int64_t sp = 0; sp < S; ++sp) {
      const float* p = part + (b * S + sp) * item;
      if (p[H + h] > 0.0f && p[h] > mx) mx = p[h];
    }
    float o[256];  // head_dim <= 256 (checked by the caller)
    float l = 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    for (int64_t sp = 0; sp < S; ++sp) {
      const float* p = part + (b * S + sp) * item;
      if (!(p[H + h] > 0.0f)) continue;  // an empty split
      const float w = std::exp(p[h] - mx);
      l += w * p[H + h];
      const float* acc = p + 2 * H + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    T* dst = out + (b * H + h) * D;
    for (int64_t d = 0; d < D; ++d) store(dst + d, o[d] * inv);
  }
}

template <typename T, int NV>
void decode(const Args& a, int num_threads) {
  const int64_t B = a.num_seqs, H = a.num_heads, D = a.head_dim, S = a.num_splits;
  const int64_t item = H * (D + 2);
  T* out = static_cast<T*>(a.out);  // [B, H, D] contiguous
  // Per split: m[H], l[H], acc[H * D]. With one split per sequence the output is written at
  // once (one barrier per call: a busy 2-core box deschedules threads, every barrier costs).
  std::vector<float> part(static_cast<size_t>(B * S * item));
  // the item after each one, by its keys [t0, t1) (see Next)
  auto keys_of = [&](int64_t it, int64_t* t0, int64_t* t1) {
    const int64_t len = a.context_lens[it / S];
    *t0 = (it % S) * a.split_keys;
    *t1 = *t0 + a.split_keys < len ? *t0 + a.split_keys : len;
  };
  const int64_t lines = (a.block_size * a.num_kv_heads * D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch;
    const bool alone = omp_get_num_threads() == 1;  // items in order: the next one is known
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t it = 0; it < B * S; ++it) {
      const int64_t b = it / S, sp = it % S;
      int64_t t0, t1;
      keys_of(it, &t0, &t1);
      Next nx;
      if (alone && it + 1 < B * S) {
        int64_t n0, n1;
        keys_of(it + 1, &n0, &n1);
        if (n0 < n1) {
          nx.table = a.block_tables + (it + 1) / S * a.max_blocks;
          nx.blk0 = n0 / a.block_size;
          nx.blocks = (n1 - 1) / a.block_size + 1 - nx.blk0;
          nx.lines = lines;
          nx.block_bytes = a.block_stride * static_cast<int64_t>(sizeof(T));
        }
      }
      float* m = part.data() + it * item;
      float* l = m + H;
      float* acc = l + H;
      if (t0 >= t1) {  // an empty split (a shorter sequence) contributes nothing
        for (int64_t h = 0; h < H; ++h) l[h] = 0.0f, m[h] = -INFINITY;
        if (S == 1)  // a sequence without context: zeros
          for (int64_t x = 0; x < H * D; ++x) store(out + b * H * D + x, 0.0f);
        continue;
      }
      run_split<T, NV>(a, b, t0, t1, m, l, acc, scratch, nx);
      if (S == 1) {  // the only split: normalize and write the output now
        for (int64_t h = 0; h < H; ++h) {
          const float inv = 1.0f / l[h];
          T* dst = out + (b * H + h) * D;
          for (int64_t d = 0; d < D; ++d) store(dst + d, acc[h * D + d] * inv);
        }
      }
    }
    if (S > 1) {
#pragma omp barrier
      merge_splits<T>(a, part.data(), out);
    }
  }
}

template <typename T>
int decode_dim(const Args& a, int num_threads) {
  switch (a.head_dim) {  // NV = head_dim / W vectors a row
    case 16: decode<T, 16 / W>(a, num_threads); return 0;
    case 32: decode<T, 32 / W>(a, num_threads); return 0;
    case 48: decode<T, 48 / W>(a, num_threads); return 0;
    case 64: decode<T, 64 / W>(a, num_threads); return 0;
    case 80: decode<T, 80 / W>(a, num_threads); return 0;
    case 96: decode<T, 96 / W>(a, num_threads); return 0;
    case 112: decode<T, 112 / W>(a, num_threads); return 0;
    case 128: decode<T, 128 / W>(a, num_threads); return 0;
    case 256: decode<T, 256 / W>(a, num_threads); return 0;
    default: return -1;
  }
}

}  // namespace

extern "C" {

// Whether head_dim is one the kernel is instantiated for (the caller falls back otherwise).
int pdserve_paged_decode_head_dim_ok(int64_t head_dim) {
  return head_dim % 16 == 0 && (head_dim <= 128 || head_dim == 256);
}

// dtype: 0 = float32, 1 = bfloat16. Returns 0, or -1 on an unsupported argument.
int pdserve_paged_decode(const void* q, const void* k_cache, const void* v_cache,
                         const int32_t* block_tables, const int32_t* context_lens, void* out,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t max_blocks,
                         int64_t q_stride_seq, int64_t q_stride_head, int64_t block_stride,
                         int64_t split_keys, int64_t num_splits, float scale, int dtype,
                         int num_threads) {
  if (!pdserve_paged_decode_head_dim_ok(head_dim) || num_kv_heads <= 0 ||
      num_heads % num_kv_heads || split_keys <= 0 || num_splits <= 0 || num_threads <= 0 ||
      block_stride < block_size * num_kv_heads * head_dim)
    return -1;
  Args a{q,            k_cache,      v_cache,      block_tables, context_lens,
         out,          num_seqs,     num_heads,    num_kv_heads, head_dim,
         block_size,   max_blocks,   q_stride_seq, q_stride_head, block_stride,
         split_keys,   num_splits,   scale};
  if (dtype == 0) return decode_dim<float>(a, num_threads);
  if (dtype == 1) return decode_dim<uint16_t>(a, num_threads);
  return -1;
}

}  // extern "C"

// A Llama-family decode forward for a few rows (<= 8) in one call: every layer's kernels
// chained natively, no Python between them.
//
// Contract: LlamaForCausalLM.forward (engine/models/llama.py) on a decode-only step through
// the CPU op set (kernels/cpu_ops.py), bit for bit: embedding, then per layer (residual
// add +) RMSNorm + qkv GEMV (+ bias), RoPE in place, K/V store into the paged cache, paged
// decode attention, o GEMV, residual add + RMSNorm + gate_up GEMV + SiLU * up, down GEMV;
// then the final residual add + RMSNorm. The hidden states written to `out` are the ones
// the per-op path returns.
//
// How it stays exact: this file does no arithmetic of its own. It calls the very kernels
// the per-op path calls through ctypes (pdserve_norm_gemv and pdserve_gemv in gemv.cpp,
// pdserve_rope, pdserve_store_kv and pdserve_rms_norm in elementwise.cpp,
// pdserve_paged_decode in paged_decode.cpp), through function pointers the caller takes
// from those libraries (kernels/decode_forward.py), with the arguments, thread counts and key
// splits the Python wrappers would pass. Each library keeps its own compiler flags
// (elementwise.cpp's -ffp-contract=off, ...). What goes away is the Python between them:
// ~10 ctypes calls, ~20 nn.Module calls and views a layer (docs/benchmarks-history.md,
// "Decode forward in fewer native calls").
//
// The model (weights, norms, RoPE table, cache pointers) is described once, at load, by a
// `Model` struct the caller keeps alive; a step passes only its inputs. Called through
// ctypes: no torch headers.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using NormGemv = int (*)(const void*, int64_t, const void*, int64_t, const void*, float, void*,
                         int64_t, const void*, int64_t, const void*, void*, int64_t, int64_t,
                         int64_t, int64_t, int, int, int);
using Gemv = int (*)(const void*, int64_t, const void*, int64_t, const void*, void*, int64_t,
                     int64_t, int64_t, int64_t, int, int, int);
using RmsNorm = int (*)(const void*, int64_t, const void*, int64_t, const void*, void*, int64_t,
                        void*, int64_t, int64_t, int64_t, float, int, int);
using Rope = int (*)(const int64_t*, void*, int64_t, int64_t, int64_t, void*, int64_t, int64_t,
                     int64_t, const float*, int64_t, int64_t, int, int);
using StoreKv = int (*)(const char*, int64_t, const char*, int64_t, char*, char*,
                        const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int);
// pdserve_gemm_packed_team (T float) or pdserve_gemm_packed_bf16_team (T uint16_t)
template <typename T>
using GemmTeam = int (*)(const T*, int64_t, const T*, int64_t, int64_t, int, const T*, const T*,
                         int64_t, T*, int64_t, int64_t);
using PagedDecode = int (*)(const void*, const void*, const void*, const int32_t*,
                            const int32_t*, void*, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int,
                            int);

}  // namespace

extern "C" {

// One decoder layer's weights (plain [out, in] rows, `*_ws` elements apart) and its K and
// V cache planes ([N, bs, Hkv, D], blocks `Model::block_stride` elements apart).
struct PdserveLayer {
  const void* input_norm;
  const void* qkv;
  int64_t qkv_ws;
  const void* qkv_bias;  // null: none
  const void* o;
  int64_t o_ws;
  const void* post_norm;
  const void* gate_up;  // [2 I, hidden]: gate rows, then up rows
  int64_t gate_up_ws;
  const void* down;
  int64_t down_ws;
  void* k_cache;
  void* v_cache;
  // the same weights packed for pdserve_gemm_packed[_bf16] (gemm_packed.cpp, the model's
  // dtype), or null: then pdserve_decode_forward_batch refuses the step
  const void* qkv_p;
  const void* o_p;
  const void* gate_up_p;
  const void* down_p;
};

struct PdserveModel {
  // the chained kernels (addresses of the extern "C" functions of the other libraries)
  const void* norm_gemv;
  const void* gemv;
  const void* rms_norm;
  const void* rope;
  const void* store_kv;
  const void* paged_decode;
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab;
  float eps, scale;
  int32_t dtype;  // 0 fp32, 1 bf16
  const void* embed;  // [vocab, hidden], rows `embed_stride` elements apart
  int64_t embed_stride;
  const void* final_norm;
  const float* cos_sin;  // [max_pos, head_dim] fp32
  int64_t max_pos;
  int64_t block_size, block_stride, num_blocks;
  // the Python wrappers' thresholds: elementwise ops go parallel from this many elements
  // (elementwise.PARALLEL_MIN_ELEMENTS); attention key splits (paged_decode.num_splits)
  int64_t parallel_min_elements, items_per_thread, min_split_keys;
  const PdserveLayer* layers;
  // pdserve_gemm_packed_team (fp32) or pdserve_gemm_packed_bf16_team (bf16), the model's
  // dtype's, or null (no batched forward)
  const void* gemm_packed_team;
  // the gate_up GEMM's `silu` mode (gemm_packed.cpp): 1 where the per-op path runs SiLU * up
  // on the GEMM's fp32 accumulators (oneDNN post-ops), 2 where it rounds gate and up first
  int32_t silu_mode;
};

}  // extern "C"

namespace {

// The inputs' range checks (nothing is written when one fails; codes as documented below)
// and the longest context.
int check_rows(const PdserveModel& md, const int64_t* ids, const int64_t* positions,
               const int64_t* slots, int64_t width, const int32_t* lens, int64_t m,
               int64_t* max_len) {
  *max_len = 0;
  for (int64_t r = 0; r < m; ++r) {
    if (ids != nullptr && (ids[r] < 0 || ids[r] >= md.vocab)) return 1;
    if (positions[r] < 0 || positions[r] >= md.max_pos) return 2;
    if (slots[r] >= md.num_blocks * md.block_size) return 3;
    if (lens[r] < 1 || lens[r] > width * md.block_size) return 4;
    *max_len = std::max<int64_t>(*max_len, lens[r]);
  }
  return 0;
}

// Layer L's attention on this step's qkv rows [m, qkv_n] (q | k | v, contiguous rows):
// RoPE on q and k in place, k and v stored at their slots, paged decode attention into
// out [m, q_size]; as kernels/elementwise.py and paged_decode.py call them.
// one_split: every sequence in one key split, whatever the thread count and the other rows
// (the batched forward: a row's bits must not depend on its step).
int attend(const PdserveModel& md, const PdserveLayer& L, char* qkv, const int64_t* positions,
           const int64_t* slots, const int32_t* tables, int64_t width, const int32_t* lens,
           int64_t m, int64_t max_len, void* out, int threads, bool one_split = false) {
  const int64_t D = md.head_dim, q_size = md.num_heads * D, kv_size = md.num_kv_heads * D;
  const int64_t qkv_n = q_size + 2 * kv_size, elem = md.dtype == 0 ? 4 : 2;
  auto small = [&](int64_t elements) { return elements >= md.parallel_min_elements ? threads : 1; };
  // paged_decode.num_splits: one split per sequence unless too few to keep threads busy
  const int64_t want = md.items_per_thread * threads;
  int64_t splits = 1;
  if (m < want && !one_split)
    splits = std::max<int64_t>(1, std::min((want + m - 1) / m, max_len / md.min_split_keys));
  const int64_t split_keys = std::max<int64_t>(1, (max_len + splits - 1) / splits);
  char* k = qkv + q_size * elem;
  char* v = k + kv_size * elem;
  int rc = reinterpret_cast<Rope>(md.rope)(positions, qkv, qkv_n, D, md.num_heads, k, qkv_n, D,
                                           md.num_kv_heads, md.cos_sin, D, m, md.dtype,
                                           small(m * q_size));
  rc |= reinterpret_cast<StoreKv>(md.store_kv)(
      k, qkv_n * elem, v, qkv_n * elem, static_cast<char*>(L.k_cache),
      static_cast<char*>(L.v_cache), slots, m, kv_size * elem, md.block_size,
      md.block_stride * elem, md.num_blocks * md.block_size, small(m * kv_size));
  rc |= reinterpret_cast<PagedDecode>(md.paged_decode)(
      qkv, L.k_cache, L.v_cache, tables, lens, out, m, md.num_heads, md.num_kv_heads, D,
      md.block_size, width, qkv_n, D, md.block_stride, split_keys, splits, md.scale, md.dtype,
      threads);
  return rc;
}

// pdserve_decode_forward_batch's body for T = float (fp32) or uint16_t (bf16), after its
// checks.
template <typename T>
int forward_batch(const PdserveModel& md, const int64_t* ids, const int64_t* positions,
                  const int64_t* slots, const int32_t* tables, int64_t width,
                  const int32_t* lens, int64_t m, int64_t max_len, void* out, int threads) {
  const auto gemm = reinterpret_cast<GemmTeam<T>>(md.gemm_packed_team);
  const auto rms_norm = reinterpret_cast<RmsNorm>(md.rms_norm);
  const int64_t hid = md.hidden, D = md.head_dim, inter = md.intermediate;
  const int64_t q_size = md.num_heads * D, qkv_n = q_size + 2 * md.num_kv_heads * D;
  const float eps = md.eps;

  // residual stream (into each layer), residual after attention, normed rows, qkv, attention
  // out, SiLU * up
  std::vector<T> buf(m * (3 * hid + qkv_n + q_size + inter));
  T* res = buf.data();
  T* res2 = res + m * hid;
  T* h = res2 + m * hid;
  T* qkv = h + m * hid;
  T* attn = qkv + m * qkv_n;
  T* act = attn + m * q_size;
  const T* embed = static_cast<const T*>(md.embed);
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(res + r * hid, embed + ids[r] * md.embed_stride, hid * sizeof(T));
  int64_t keys = 0;
  for (int64_t r = 0; r < m; ++r) keys += lens[r] + 1;

  // the whole team even for fewer rows than threads: the GEMMs split their columns over
  // it (a 1-row step on one thread ran at half the GEMV path's speed on 2 threads); a
  // thread with no rows of its own skips the norms and attention
  threads = std::max(1, threads);
  std::vector<int> rcs(threads, 0);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    // this thread's rows [r0, r1): the first row whose running key count reaches t / nt of
    // all keys starts range t
    int64_t r0 = 0, r1 = 0, run = 0;
    for (int64_t r = 0; r < m; ++r) {
      if (run * nt < keys * t) r0 = r + 1;
      if (run * nt < keys * (t + 1)) r1 = r + 1;
      run += lens[r] + 1;
    }
    if (t == 0) r0 = 0;
    if (t == nt - 1) r1 = m;
    const int64_t rows = r1 - r0;
    int rc = 0;
    auto norm = [&](const T* x, const void* w, T* dst) {
      if (rows > 0)
        rc |= rms_norm(x + r0 * hid, hid, nullptr, 0, w, dst + r0 * hid, hid, nullptr, 0, rows,
                       hid, eps, md.dtype, 1);
    };
    for (int64_t i = 0; i < md.num_layers; ++i) {
      const PdserveLayer& L = md.layers[i];
      norm(res, L.input_norm, h);
#pragma omp barrier
      rc |= gemm(h, hid, static_cast<const T*>(L.qkv_p), qkv_n, hid, 0,
                 static_cast<const T*>(L.qkv_bias), nullptr, 0, qkv, qkv_n, m);
#pragma omp barrier
      if (rows > 0)
        rc |= attend(md, L, reinterpret_cast<char*>(qkv + r0 * qkv_n), positions + r0,
                     slots + r0, tables + r0 * width, width, lens + r0, rows, max_len,
                     attn + r0 * q_size, 1, true);
#pragma omp barrier
      rc |= gemm(attn, q_size, static_cast<const T*>(L.o_p), hid, q_size, 0, nullptr, res, hid,
                 res2, hid, m);
#pragma omp barrier
      norm(res2, L.post_norm, h);
#pragma omp barrier
      rc |= gemm(h, hid, static_cast<const T*>(L.gate_up_p), inter, hid, md.silu_mode, nullptr,
                 nullptr, 0, act, inter, m);
#pragma omp barrier
      rc |= gemm(act, inter, static_cast<const T*>(L.down_p), hid, inter, 0, nullptr, res2, hid,
                 res, hid, m);
#pragma omp barrier
    }
    norm(res, md.final_norm, static_cast<T*>(out));
    rcs[t] = rc;
  }
  for (const int rc : rcs)
    if (rc != 0) return 5;
  return 0;
}

}  // namespace

extern "C" {

// Hidden states [m, hidden] of a decode step of m rows (one new token each) into `out`.
// ids, positions, slots [m] int64; tables [m, width] int32 (rows `width` apart); lens [m]
// int32. Returns 0; before anything is written: 1 a token id outside the vocabulary, 2 a
// position outside the RoPE table, 3 a slot outside the cache, 4 a context length outside
// [1, width * block_size]; 5 a kernel refused its arguments (after some layers ran).
int pdserve_decode_forward(const PdserveModel* p, const int64_t* ids, const int64_t* positions,
                           const int64_t* slots, const int32_t* tables, int64_t width,
                           const int32_t* lens, int64_t m, void* out, int threads) {
  const PdserveModel& md = *p;
  const int64_t hid = md.hidden, D = md.head_dim;
  const int64_t q_size = md.num_heads * D, kv_size = md.num_kv_heads * D;
  const int64_t qkv_n = q_size + 2 * kv_size, inter = md.intermediate;
  const int64_t elem = md.dtype == 0 ? 4 : 2;
  int64_t max_len = 0;
  const int bad = check_rows(md, ids, positions, slots, width, lens, m, &max_len);
  if (bad != 0) return bad;
  const auto norm_gemv = reinterpret_cast<NormGemv>(md.norm_gemv);
  const auto gemv = reinterpret_cast<Gemv>(md.gemv);
  const auto rms_norm = reinterpret_cast<RmsNorm>(md.rms_norm);

  // activations, in bytes: x (layer input), two residuals, qkv, attention out, o out, h
  std::vector<char> buf(elem * m * (4 * hid + qkv_n + q_size + inter));
  char* x = buf.data();
  char* res[2] = {x + elem * m * hid, x + 2 * elem * m * hid};
  char* xo = x + 3 * elem * m * hid;
  char* qkv = x + 4 * elem * m * hid;
  char* attn = qkv + elem * m * qkv_n;
  char* h = attn + elem * m * q_size;
  const char* embed = static_cast<const char*>(md.embed);
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(x + r * hid * elem, embed + ids[r] * md.embed_stride * elem, hid * elem);

  const char* resid = nullptr;  // layer 0: no residual yet (its residual is x itself)
  int cur = 0;
  int rc = 0;
  for (int64_t i = 0; i < md.num_layers && rc == 0; ++i) {
    const PdserveLayer& L = md.layers[i];
    // (residual add +) input RMSNorm + qkv projection
    char* res_out = resid == nullptr ? x : res[cur];
    rc |= norm_gemv(x, hid, resid, hid, L.input_norm, md.eps, res_out, hid, L.qkv, L.qkv_ws,
                    L.qkv_bias, qkv, qkv_n, m, qkv_n, hid, md.dtype, threads, 0);
    resid = res_out;
    rc |= attend(md, L, qkv, positions, slots, tables, width, lens, m, max_len, attn, threads);
    rc |= gemv(attn, q_size, L.o, L.o_ws, nullptr, xo, hid, m, hid, q_size, md.dtype, threads, 0);
    // residual add + post-attention RMSNorm + gate_up + SiLU * up, then down
    cur ^= 1;
    rc |= norm_gemv(xo, hid, resid, hid, L.post_norm, md.eps, res[cur], hid, L.gate_up,
                    L.gate_up_ws, nullptr, h, inter, m, inter, hid, md.dtype, threads, 1);
    resid = res[cur];
    cur ^= 1;
    rc |= gemv(h, inter, L.down, L.down_ws, nullptr, x, hid, m, hid, inter, md.dtype, threads, 0);
  }
  if (rc != 0) return 5;
  // final residual add + RMSNorm (the residual sum itself is not needed: into xo)
  if (rms_norm(x, hid, resid, hid, md.final_norm, out, hid, xo, hid, m, hid, md.eps, md.dtype,
               m * hid >= md.parallel_min_elements ? threads : 1) != 0)
    return 5;
  return 0;
}

// Larger decode steps (their GEMMs stay oneDNN's, in Python): layer `layer`'s RoPE, K/V
// store and paged decode attention in one call, on qkv [m, qkv_n] contiguous, into out
// [m, q_size]. Returns as pdserve_decode_forward (no token ids here: never 1).
int pdserve_decode_attention(const PdserveModel* p, int64_t layer, void* qkv,
                             const int64_t* positions, const int64_t* slots,
                             const int32_t* tables, int64_t width, const int32_t* lens,
                             int64_t m, void* out, int threads) {
  const PdserveModel& md = *p;
  if (layer < 0 || layer >= md.num_layers) return 5;
  int64_t max_len = 0;
  const int bad = check_rows(md, nullptr, positions, slots, width, lens, m, &max_len);
  if (bad != 0) return bad;
  const int rc = attend(md, md.layers[layer], static_cast<char*>(qkv), positions, slots, tables,
                        width, lens, m, max_len, out, threads);
  return rc != 0 ? 5 : 0;
}


// Larger decode steps, fp32 or bf16, as one call and ONE OpenMP parallel region: the whole
// forward runs on a fixed team, with barriers between its phases instead of a fork and join
// per kernel. GEMMs are gemm_packed.cpp's on the packed weights (each thread its share of
// the columns), the residual add fused into the o and down projections' stores, SiLU * up
// into the gate_up projection's; RMSNorm, RoPE, the K/V store and paged attention are the
// same kernels as above, each thread calling them with one thread on its own rows (rows
// cut so that the threads get about equal attention work: keys + 1 a row). Per layer: norm
// | qkv | RoPE + store + attention | o (+ residual) | norm | gate_up + SiLU * up | down (+
// residual), "|" a barrier. bf16: activations are bf16 between the phases, rounded where
// the per-op path's bf16 tensors round. Same inputs and return codes as
// pdserve_decode_forward; 6 when the model has no packed weights: nothing written.
int pdserve_decode_forward_batch(const PdserveModel* p, const int64_t* ids,
                                 const int64_t* positions, const int64_t* slots,
                                 const int32_t* tables, int64_t width, const int32_t* lens,
                                 int64_t m, void* out, int threads) {
  const PdserveModel& md = *p;
  if ((md.dtype != 0 && md.dtype != 1) || md.gemm_packed_team == nullptr) return 6;
  if (md.silu_mode != 1 && md.silu_mode != 2) return 6;
  for (int64_t i = 0; i < md.num_layers; ++i) {
    const PdserveLayer& L = md.layers[i];
    if (!L.qkv_p || !L.o_p || !L.gate_up_p || !L.down_p) return 6;
  }
  int64_t max_len = 0;
  const int bad = check_rows(md, ids, positions, slots, width, lens, m, &max_len);
  if (bad != 0) return bad;
  if (md.dtype == 0)
    return forward_batch<float>(md, ids, positions, slots, tables, width, lens, m, max_len, out,
                                threads);
  return forward_batch<uint16_t>(md, ids, positions, slots, tables, width, lens, m, max_len, out,
                                 threads);
}

}  // extern "C"

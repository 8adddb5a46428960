// AMX tiles in software, for testing gemm_packed.cpp's AMX path (gemm_panels_amx) on a CPU
// without them: built with -DPDSERVE_AMX_EMULATE=1 (kernels/native.py, with
// $PDSERVE_KERNEL_AMX_EMULATE set), the kernel's tile operations come from here instead of
// the AMX instructions, so its tiling, tile configuration, strides, row tails and epilogue
// run on any AVX-512 bf16 CPU (tests/test_gemm_packed.py). Never the speed path.
//
// Semantics as Intel's SDM gives them (palette 1: 8 tiles of up to 16 rows x 64 bytes):
// TILELOADD reads `rows` rows of `colsb` bytes, `stride` bytes apart, and zeroes the rest
// of the tile; TILESTORED writes `rows` rows of `colsb` bytes; TDPBF16PS, for each row m of
// C and each k pair of A's row: C[m][n] += A[m][2k] B[k][2n], then += A[m][2k + 1]
// B[k][2n + 1], each product exact in fp32 (bf16 x bf16), bf16 denormal inputs read as
// zero and fp32 denormal results flushed to zero, round to nearest even.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdserve_amx_emulate {

constexpr int kTiles = 8, kRows = 16, kRowBytes = 64;

struct State {
  uint8_t rows[kTiles] = {};
  uint16_t colsb[kTiles] = {};
  alignas(64) uint8_t data[kTiles][kRows][kRowBytes] = {};
};

// Each thread its own tiles, as each core has its own tile registers.
inline State& state() {
  static thread_local State s;
  return s;
}

// The 64-byte configuration layout of LDTILECFG (palette 1).
inline void loadconfig(const void* cfg) {
  const uint8_t* c = static_cast<const uint8_t*>(cfg);
  State& s = state();
  for (int t = 0; t < kTiles; ++t) {
    std::memcpy(&s.colsb[t], c + 16 + 2 * t, 2);
    s.rows[t] = c[48 + t];
  }
  std::memset(s.data, 0, sizeof(s.data));
}

inline void release() { state() = State(); }

inline void zero(int t) { std::memset(state().data[t], 0, sizeof(state().data[t])); }

inline void loadd(int t, const void* base, int64_t stride) {
  State& s = state();
  std::memset(s.data[t], 0, sizeof(s.data[t]));
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(s.data[t][r], static_cast<const uint8_t*>(base) + r * stride, s.colsb[t]);
}

inline void stored(int t, void* base, int64_t stride) {
  const State& s = state();
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[t][r], s.colsb[t]);
}

inline float bf16_daz(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  if ((h & 0x7f80u) == 0) h &= 0x8000u;  // a denormal (or zero) reads as a signed zero
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float ftz(float f) { return std::fabs(f) < FLT_MIN ? std::copysign(0.0f, f) : f; }

inline void dpbf16ps(int c, int a, int b) {
  State& s = state();
  for (int m = 0; m < s.rows[c]; ++m) {
    float* acc = reinterpret_cast<float*>(s.data[c][m]);
    for (int k = 0; k < s.colsb[a] / 4; ++k) {
      const float a0 = bf16_daz(&s.data[a][m][4 * k]), a1 = bf16_daz(&s.data[a][m][4 * k + 2]);
      for (int n = 0; n < s.colsb[c] / 4; ++n) {
        const float b0 = bf16_daz(&s.data[b][k][4 * n]), b1 = bf16_daz(&s.data[b][k][4 * n + 2]);
        acc[n] = ftz(acc[n] + a0 * b0);  // the products are exact: an FMA adds the same
        acc[n] = ftz(acc[n] + a1 * b1);
      }
    }
  }
}

}  // namespace pdserve_amx_emulate

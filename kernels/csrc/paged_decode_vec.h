// Vector primitives of the paged decode attention kernel (paged_decode.cpp): the vector
// width, loads that widen bf16 to fp32, and the exp of its softmax. Only paged_decode.cpp
// includes it, compiled with that source's flags (kernels/native.py hashes every header
// into every library's name, so a change here rebuilds).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve_decode_vec {

// One vector: 16 floats (a zmm) with AVX-512, else 8 (a ymm; wider generic vectors would
// be split into register pairs and spill). Rows are D = NV * W elements.
#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int kAccVectors = 16;  // accumulators kept in registers (of 32 zmm)
#else
constexpr int W = 8;
constexpr int kAccVectors = 8;  // of 16 ymm
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint16_t vu16 __attribute__((vector_size(2 * W)));
typedef uint32_t vu32 __attribute__((vector_size(4 * W)));

// Keys whose K (and V) rows are prefetched ahead (blocks sit anywhere in the cache).
constexpr int64_t kPrefetchKeys = 16;

inline vf loadv(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline vf loadv(const uint16_t* p) {  // bf16 -> fp32: the bits shifted into the high half
#if defined(__AVX512F__)  // one 512-bit widening (GCC splits the generic form into halves)
  const __m512i wide =
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#else
  vu16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const vu32 wide = __builtin_convertvector(raw, vu32) << 16;
#endif
  vf x;
  std::memcpy(&x, &wide, sizeof(x));
  return x;
}

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

}  // namespace pdserve_decode_vec

// bf16 <-> fp32 and typed load/store, shared by the CPU kernels (kernels/csrc/*.cpp).
#pragma once

#include <cfloat>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace pdserve_cpu {

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (NaN stays NaN)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512BF16__)
// 16 lanes of float_to_bf16 (the same bits for every input): vcvtneps2bf16 rounds to
// nearest even in one instruction and quiets a NaN as float_to_bf16 does, but reads a
// denormal input as zero; lanes holding one (never seen in activations) take
// float_to_bf16's integer rounding instead.
inline __m256i float_to_bf16_v(__m512 x) {
  __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
  const __m512 ax = _mm512_abs_ps(x);
  const __mmask16 sub = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(FLT_MIN), _CMP_LT_OQ) &
                        _mm512_cmp_ps_mask(ax, _mm512_setzero_ps(), _CMP_NEQ_OQ);
  if (sub) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i rne = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    r = _mm256_mask_mov_epi16(r, sub, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rne, 16)));
  }
  return r;
}
inline __m512 bf16_to_float_v(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// the lanes of `m` of p (others zero), widened to fp32
inline __m512 load_bf16_v(__mmask16 m, const uint16_t* p) {
  return bf16_to_float_v(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 round_bf16_v(__m512 x) { return bf16_to_float_v(float_to_bf16_v(x)); }
// the first n (< 16: a tail) or all 16 lanes
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}
#endif

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16_to_float(*p); }
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) { *p = float_to_bf16(x); }

}  // namespace pdserve_cpu

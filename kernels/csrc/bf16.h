// bf16 <-> fp32 and typed load/store, shared by the CPU kernels (kernels/csrc/*.cpp).
#pragma once

#include <cstdint>
#include <cstring>

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

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16_to_float(*p); }
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) { *p = float_to_bf16(x); }

}  // namespace pdserve_cpu

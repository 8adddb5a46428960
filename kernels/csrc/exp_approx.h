// exp(x) as the CPU kernels compute it (elementwise SiLU, prefill attention's softmax):
// vectorizable, shared so both round alike. Each source compiles it with its own flags.
#pragma once

#include <cstdint>
#include <cstring>

namespace pdserve_cpu {

// exp(x), vectorizable: Cody-Waite range reduction x = i ln2 + r, |r| <= ln2/2, then a
// degree-7 Taylor polynomial (relative error ~1e-7); x clamped to [-87, 88].
#pragma omp declare simd notinbranch
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float fi = (x * 1.4426950408889634f + magic) - magic;
  float r = x - fi * 0.693145751953125f;  // ln2 split in a short high part ...
  r = r - fi * 1.428606765330187e-06f;    // ... and the rest
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

}  // namespace pdserve_cpu

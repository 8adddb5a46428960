// Row-wise argmax of fp32 logits on CPU: the greedy pick of every sampling row in one call.
//
// Contract: torch.argmax(x, dim=-1) on a [rows, n] fp32 matrix whose rows are contiguous:
// the first index of the maximum; a row holding a NaN gets its first NaN's index (torch
// treats NaN as the maximum). One thread, on the caller's: torch's argmax is slower even
// on one thread, and on two it opens a parallel region whose join waits for a descheduled
// thread on a busy box (docs/benchmarks-history.md, "bf16 decode step"). Called through
// ctypes (kernels/argmax.py).

#include <cstdint>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

// The row's max (four 16-lane accumulators: no dependency chain on one), and whether it
// holds a NaN (compared as unordered).
inline float row_max(const float* x, int64_t n, bool* nan) {
  float m = x[0];
  int64_t i = 0;
  if (n >= 64) {
    v16 a = load16(x), b = load16(x + 16), c = load16(x + 32), d = load16(x + 48);
    i16 un = (a != a) | (b != b) | (c != c) | (d != d);
    for (i = 64; i + 64 <= n; i += 64) {
      const v16 p = load16(x + i), q = load16(x + i + 16);
      const v16 r = load16(x + i + 32), t = load16(x + i + 48);
      a = p > a ? p : a;
      b = q > b ? q : b;
      c = r > c ? r : c;
      d = t > d ? t : d;
      un |= (p != p) | (q != q) | (r != r) | (t != t);
    }
    a = b > a ? b : a;
    c = d > c ? d : c;
    a = c > a ? c : a;
    for (int l = 0; l < 16; ++l) {
      m = a[l] > m ? a[l] : m;
      *nan |= un[l] != 0;
    }
  }
  for (; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    *nan |= x[i] != x[i];
  }
  return m;
}

int64_t argmax_row(const float* x, int64_t n) {
  bool nan = false;
  const float m = row_max(x, n, &nan);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {  // the first 64 holding m (or a NaN), then the element
    const v16 p = load16(x + i), q = load16(x + i + 16);
    const v16 r = load16(x + i + 32), t = load16(x + i + 48);
    const i16 hit = nan ? (p != p) | (q != q) | (r != r) | (t != t)
                        : (p == m) | (q == m) | (r == m) | (t == m);
    bool any = false;
    for (int l = 0; l < 16; ++l) any |= hit[l] != 0;
    if (any) break;
  }
  for (; i < n; ++i)
    if (nan ? x[i] != x[i] : x[i] == m) return i;
  return 0;
}

}  // namespace

extern "C" {

// out[r] = argmax of row r (x + r * row_stride, n elements). Returns 0, or -1 if n < 1.
int pdserve_argmax_rows(const float* x, int64_t row_stride, int64_t rows, int64_t n,
                        int64_t* out) {
  if (n < 1) return -1;
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * row_stride, n);
  return 0;
}

}  // extern "C"

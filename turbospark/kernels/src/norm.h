// One row's RMSNorm as mx.fast.rms_norm's CPU fallback computes it: the sum of squares in
// float32, in order; each value scaled and rounded to T, times the weight, rounded to T.  The
// RmsNorm primitive (fused.cpp) and a product's norm prologue (rows.cpp) both use it, so the two
// give the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "round.h"

namespace turbospark::kernels {

// x(d): element d as float32; w: the weight (nullptr: none), stride ws; out(d, v): the result, in T
template <class T, class X, class Out>
inline void rms_norm_row(int D, float eps, const T* w, int64_t ws, X x, Out out) {
  float ss = 0;
  for (int d = 0; d < D; ++d) {
    const float v = x(d);
    ss += v * v;
  }
  const float inv = 1.0f / std::sqrt(ss / float(D) + eps);
  for (int d = 0; d < D; ++d) {
    float y = round_to<T>(x(d) * inv);
    if (w) y *= static_cast<float>(w[d * ws]);
    out(d, static_cast<T>(y));
  }
}

} // namespace turbospark::kernels

// Reading an MLX array of any layout by rows (every dimension but the last).
#pragma once

#include <cstdint>

#include "mlx/array.h"

namespace turbospark::kernels {

// Elements from a's data pointer to the start of row r (rows in row-major order).
inline int64_t row_offset(const mlx::core::array& a, int64_t r) {
  if (a.flags().row_contiguous) return r * a.shape(-1);
  int64_t off = 0;
  for (int d = int(a.ndim()) - 2; d >= 0; --d) {
    const int64_t n = a.shape(d);
    off += (r % n) * a.strides(d);
    r /= n;
  }
  return off;
}

} // namespace turbospark::kernels

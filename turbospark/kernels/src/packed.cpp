// MLX's affine 4- and 8-bit layouts packed eight output rows together, and back (rows_kernels.h).
#include <cstring>

#include "rows_kernels.h"

namespace turbospark::kernels {

namespace {
// chunk c's weights: MLX's row-major bytes (8 rows of K * bits / 8) <-> packed (per 32 weights b
// and dword u of their `bits` dwords, the eight rows' dword u side by side)
void move_weights(const uint8_t* from, uint8_t* to, int K, int bits, bool to_packed) {
  const size_t row = size_t(K) * bits / 8;
  for (int b = 0; b < K / 32; ++b)
    for (int u = 0; u < bits; ++u)
      for (int i = 0; i < 8; ++i) {
        const size_t mlx = i * row + 4 * (size_t(b) * bits + u), packed = (size_t(b) * bits + u) * 32 + 4 * i;
        if (to_packed) std::memcpy(to + packed, from + mlx, 4);
        else std::memcpy(to + mlx, from + packed, 4);
      }
}

// chunk c's scales or biases: [row][group] <-> [group][row], S bytes each
void move_params(const uint8_t* from, uint8_t* to, int S, int groups, bool to_packed) {
  for (int i = 0; i < 8; ++i)
    for (int g = 0; g < groups; ++g) {
      const size_t mlx = (size_t(i) * groups + g) * S, packed = (size_t(g) * 8 + i) * S;
      if (to_packed) std::memcpy(to + packed, from + mlx, S);
      else std::memcpy(to + mlx, from + packed, S);
    }
}
} // namespace

void pack_q(const uint8_t* w, const uint8_t* scales, const uint8_t* biases, int S, int N, int K, int G, int bits,
            bool to_packed, uint8_t* w_out, uint8_t* scales_out, uint8_t* biases_out) {
  const int groups = K / G;
  const size_t wbytes = size_t(K) * bits, pbytes = size_t(8) * groups * S;
  for (int c = 0; c < N / 8; ++c) {
    move_weights(w + c * wbytes, w_out + c * wbytes, K, bits, to_packed);
    move_params(scales + c * pbytes, scales_out + c * pbytes, S, groups, to_packed);
    move_params(biases + c * pbytes, biases_out + c * pbytes, S, groups, to_packed);
  }
}

} // namespace turbospark::kernels

// Rounding a float32 to an MLX float type and back, as an MLX op whose output has that type does.
#pragma once

#include <type_traits>

namespace turbospark::kernels {

template <class T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return static_cast<float>(static_cast<T>(v));
  }
}

} // namespace turbospark::kernels

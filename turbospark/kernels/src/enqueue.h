// How each primitive's eval_cpu hands its work to MLX's stream thread.
#pragma once

#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace turbospark::kernels {

// Allocates `out` (unless eval_cpu gave it a buffer already: a donated input's), registers the
// arrays with the stream's command encoder and enqueues `work(inputs, out)` on the stream's
// thread, in order with MLX's own ops (the arrays it gets are weak copies: the encoder keeps the
// buffers alive).
template <class Work>
void enqueue(const mlx::core::Stream& stream, const std::vector<mlx::core::array>& inputs, mlx::core::array& out,
             Work&& work) {
  namespace mx = mlx::core;
  if (!out.data_shared_ptr()) out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> in;
  for (auto& a : inputs) {
    encoder.set_input_array(a);
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  encoder.set_output_array(out);
  encoder.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(out),
                    work = std::forward<Work>(work)]() mutable { work(in, out); });
}

} // namespace turbospark::kernels

// MLX primitives for the small ops of a decoder layer on the CPU: RMSNorm, RoPE and attention,
// each one op where MLX's CPU backend runs a graph of 6 to 20 (mx.fast's fallbacks).  Their
// arithmetic follows those fallbacks: RMSNorm normalizes in float32 and rounds before the
// weight; RoPE's angles are float32 and its products round to the input's type as MLX's do;
// attention computes its scores and softmax in float32.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace turbospark::kernels {

namespace mx = mlx::core;

// mx.fast.rms_norm(x, weight, eps)
mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps, mx::StreamOrDevice s = {});

// mx.fast.rope(x, dims, traditional=, base=, scale=, offset=, freqs=) with offset a scalar or one
// per batch row (int32)
mx::array rope(const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale,
               const mx::array& offset, const std::optional<mx::array>& freqs, mx::StreamOrDevice s = {});

// mx.fast.scaled_dot_product_attention(q, k, v, scale=, mask=, sinks=): mask_mode "", "causal" or
// "array" (mask bool or additive, broadcastable to (B, Hq, Lq, Lk))
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::string& mask_mode, const std::optional<mx::array>& mask,
                    const std::optional<mx::array>& sinks, mx::StreamOrDevice s = {});

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps, bool has_weight)
      : mx::UnaryPrimitive(stream), eps_(eps), has_weight_(has_weight) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override;
  const char* name() const override { return "TurbosparkRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  float eps_;
  bool has_weight_;
};

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale, bool has_freqs)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale),
        has_freqs_(has_freqs) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override;
  const char* name() const override { return "TurbosparkRope"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
  bool has_freqs_;
};

class Attention : public mx::UnaryPrimitive {
 public:
  Attention(mx::Stream stream, float scale, bool causal, bool has_mask, bool has_sinks)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal), has_mask_(has_mask), has_sinks_(has_sinks) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override;
  const char* name() const override { return "TurbosparkAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  bool causal_;
  bool has_mask_;
  bool has_sinks_;
};

} // namespace turbospark::kernels

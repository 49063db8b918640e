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
// "array" (mask bool or additive, broadcastable to (B, Hq, Lq, Lk)).  merged: the output is
// (B, Lq, Hq * Dv), the heads side by side, as the output projection reads them.
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::string& mask_mode, const std::optional<mx::array>& mask,
                    const std::optional<mx::array>& sinks, bool merged = false, mx::StreamOrDevice s = {});

// mx.logsumexp(x, axis=-1, keepdims=True) for float32 x: MLX's CPU loop (its maximum, then the
// sum of exp(x - maximum) in order, then log) with its exp taken 8 values at a time, the same bits.
// The engine takes it of every step's logits, over the whole vocabulary.
mx::array logsumexp(const mx::array& x, mx::StreamOrDevice s = {});

// One product's q, k and v, (B, L, (Hq + 2 * Hkv) * D), as the three (B, H, L, D) arrays attention
// takes: views of the product's buffer, in one op (the reshapes and transposes of a layer).
std::vector<mx::array> split_heads(const mx::array& qkv, int hq, int hkv, mx::StreamOrDevice s = {});

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
  Attention(mx::Stream stream, float scale, bool causal, bool has_mask, bool has_sinks, bool merged, int kv_fmt = 0)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal), has_mask_(has_mask), has_sinks_(has_sinks),
        merged_(merged), kv_fmt_(kv_fmt) {}
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
  bool merged_;
  int kv_fmt_;  // keys and values as floats (0), or in blocks of 32: q8_0 (1, int8), q4_0 (2, uint8)
};

// A KV cache held in blocks of 32 values: 0 floats, 1 llama.cpp's q8_0 (an int8 array of 34 bytes
// a block), 2 its q4_0 (a uint8 array of 18 bytes a block); and the bytes of one block.
int kv_format(mx::Dtype t);
inline int kv_block_bytes(int fmt) { return fmt == 1 ? 34 : 18; }

// A KV cache's write and read: keys[..., at:at + L, :] = k and the same for values (one op each,
// in place where the cache's buffer can be donated, as MLX's slice update does), then
// keys[..., :at + L, :] and values[..., :at + L, :] (slices: views).  Returns the new keys and
// values buffers and the two views.  Float32 rows go into a float16 cache as astype rounds them,
// and into a cache in blocks (kv_format) quantized as llama.cpp's quantize_row_q8_0 and
// quantize_row_q4_0 quantize them.
std::vector<mx::array> kv_write(const mx::array& keys, const mx::array& values, const mx::array& k,
                                const mx::array& v, int at, mx::StreamOrDevice s = {});

class KvWrite : public mx::UnaryPrimitive {
 public:
  KvWrite(mx::Stream stream, int at) : mx::UnaryPrimitive(stream), at_(at) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "TurbosparkKvWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int at_;
};

class LogSumExp : public mx::UnaryPrimitive {
 public:
  explicit LogSumExp(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override;
  const char* name() const override { return "TurbosparkLogSumExp"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

class SplitHeads : public mx::Primitive {
 public:
  SplitHeads(mx::Stream stream, int hq, int hkv) : mx::Primitive(stream), hq_(hq), hkv_(hkv) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "TurbosparkSplitHeads"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int hq_;
  int hkv_;
};

} // namespace turbospark::kernels

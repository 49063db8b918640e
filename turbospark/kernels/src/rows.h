// MLX primitives: matrix times a few rows on the CPU (rows_kernels.h), for float32, bfloat16 and
// float16 weights and MLX's affine 4- and 8-bit layout.
#pragma once

#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace turbospark::kernels {

namespace mx = mlx::core;

// What a product does with its result y = x @ W.T (+ bias) before writing it (in x's type T):
// nothing; adds a residual r of the output's shape, T(r + T(y)), as `r + linear(x)` would; or,
// for W the gate's and the up projection's rows one after the other (N = 2 * H), writes the H
// values swiglu(T(y[:H]), T(y[H:])) = silu(gate) * up, as mlx-lm's MLP computes them; or, for
// Gemma's MLP, T(T(gelu_approx(g)) * u) of g = T(y[:H]), u = T(y[H:]): gelu's tanh approximation
// as g * sigmoid(2 c (g + 0.044715 g^3)), c = sqrt(2 / pi), in float32 (within a few units of the
// last place of MLX's own ops, which round each of their steps to T); or T(gelu(T(y))), nn.gelu's
// exact GELU, y (1 + erf(y / sqrt 2)) / 2 in float32 (erf within 1.5e-7: Whisper's MLP and convs).
enum class Epilogue : int { None = 0, Residual = 1, Swiglu = 2, Geglu = 3, Gelu = 4 };
// Which activation a product's epilogue applies: a gated one to its two halves (Epilogue's Swiglu,
// Geglu), or GELU to every value.
enum Glu : int { NoGlu = 0, SwiGlu = 1, GeGlu = 2, Gelu = 3 };

// A product may first normalize x as mx.fast.rms_norm(x, norm, eps) does (kernels' RmsNorm, the
// same bits: x normalized in float32, rounded to x's type, times the weight, rounded): a decoder
// layer's norm and the product that reads it, in one op.
struct Prologue {
  std::optional<mx::array> norm;  // (K,), x's type
  float eps = 0.0f;
};

// x @ w.T (+ bias), as nn.Linear computes it: x (..., K), w (N, K).
mx::array rows_matmul(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                      const std::optional<mx::array>& residual = std::nullopt, int glu = NoGlu,
                      const Prologue& prologue = {}, mx::StreamOrDevice s = {});

// x @ dequantize(w, scales, biases).T (+ bias), as nn.QuantizedLinear computes it (affine mode,
// transposed): w (N, K * bits / 32) uint32, scales and biases (N, K / group_size).
// `packed`: weights that pack_quantized packed (their shapes are MLX's).
mx::array rows_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                const mx::array& biases, const std::optional<mx::array>& bias,
                                int group_size, int bits, const std::optional<mx::array>& residual = std::nullopt,
                                int glu = NoGlu, const Prologue& prologue = {}, bool packed = false,
                                mx::StreamOrDevice s = {});

// 4- or 8-bit weights packed eight output rows together (pack_q, rows_kernels.h), as new arrays of
// the same shapes: the layout the kernels' products read fastest, with the same bytes.  Only
// rows_quantized_matmul(..., packed=true) reads them.  N must be a multiple of 8, K of 32.
std::vector<mx::array> pack_quantized(const mx::array& w, const mx::array& scales, const mx::array& biases,
                                      int group_size, int bits);
// x @ W.T (+ bias, + residual or swiglu, after the norm) for W in Q4_K super-blocks packed
// eight rows together: w the nibbles as pack_quantized packs 4-bit weights (N, K / 8) uint32,
// fields the chunks' K4Fields (rows_kernels.h) as uint8.  N a multiple of 8, K of 256.
mx::array rows_k4_matmul(const mx::array& x, const mx::array& w, const mx::array& fields,
                         const std::optional<mx::array>& bias, const std::optional<mx::array>& residual,
                         int glu, const Prologue& prologue, mx::StreamOrDevice s = {});
// The same for Q6_K super-blocks packed eight rows together: w the low nibbles (N, K / 8) uint32,
// highs their high bits (N, K / 16) uint32, fields the chunks' K6Fields as uint8.
mx::array rows_k6_matmul(const mx::array& x, const mx::array& w, const mx::array& highs, const mx::array& fields,
                         const std::optional<mx::array>& bias, const std::optional<mx::array>& residual,
                         int glu, const Prologue& prologue, mx::StreamOrDevice s = {});
// The same for Q5_0 and Q5_1 blocks packed eight rows together: highs their fifth bits (N, K / 32)
// uint32, fields the chunks' K5Fields as uint8.
mx::array rows_k5_matmul(const mx::array& x, const mx::array& w, const mx::array& highs, const mx::array& fields,
                         const std::optional<mx::array>& bias, const std::optional<mx::array>& residual,
                         int glu, const Prologue& prologue, mx::StreamOrDevice s = {});
// The same for Q5_K super-blocks packed eight rows together: Q4_K's nibbles and K4Fields with
// Q5's fifth bits (N, K / 32) uint32.
mx::array rows_k5k_matmul(const mx::array& x, const mx::array& w, const mx::array& highs, const mx::array& fields,
                          const std::optional<mx::array>& bias, const std::optional<mx::array>& residual,
                          int glu, const Prologue& prologue, mx::StreamOrDevice s = {});
// Whether the instruction set in use reads packed Q4_K (bits 4), Q5_0/Q5_1/Q5_K (5) or Q6_K (6)
// directly (elsewhere: dequantized per row).
bool reads_k(int bits);
// Whether the instruction set in use reads packed weights of `bits` directly (elsewhere they are
// unpacked for every product: correct, and slower).
bool reads_packed(int bits);

class RowsMatmul : public mx::UnaryPrimitive {
 public:
  // bits 0: float weights; 4 or 8: affine quantized.
  RowsMatmul(mx::Stream stream, int group_size, int bits, bool has_bias, Epilogue epilogue = Epilogue::None,
             bool has_norm = false, float eps = 0.0f, bool packed = false, int ggml_type = -1)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), has_bias_(has_bias), epilogue_(epilogue),
        has_norm_(has_norm), eps_(eps), packed_(packed), ggml_type_(ggml_type) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "RowsMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
  bool has_bias_;
  Epilogue epilogue_;
  bool has_norm_;  // the last input: RMSNorm's weight (Prologue)
  float eps_;
  bool packed_;  // 4-bit weights as pack_quantized left them
  int ggml_type_;  // >= 0: weights in this GGUF block type, read through ggml (ggml_blocks.h)
};

// The instruction sets this build has and this CPU runs, best first; which one the kernels use.
std::vector<std::string> isas();
std::string isa();
bool use_isa(const std::string& name);
// Whether affine 4-bit products round x to 8 bits per 32 values where the instruction set has
// integer dot products (the default; TURBOSPARK_KERNELS_EXACT=1 turns it off): about 3x faster
// at one row, the same rounding llama.cpp's Q8_0 dot products make.  Off: x stays float32.
std::atomic<bool>& activations_in_8_bits();
// Whether they do now: the setting, where the instruction set in use can.
bool x_in_8_bits();
int threads();

// Backs the arrays' memory with transparent huge pages where the kernel allows (Linux
// MADV_COLLAPSE): a weight matrix read once per step then costs far fewer TLB misses (~1.8x the
// bandwidth of 4 KiB pages on x86).  Adjacent buffers are taken together, since most of a small
// model's matrices are under 2 MiB each.  Returns the bytes now in huge pages.
size_t huge_pages(const std::vector<mx::array>& arrays);

} // namespace turbospark::kernels

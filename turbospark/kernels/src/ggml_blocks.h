// GGUF's block formats (K-quants, Q5, IQ4...) read as they are stored, through ggml's own CPU
// code: a pinned build of ggml (scripts/setup builds it from the llama-cpp-python sdist's
// sources), one library per instruction set, loaded at run time (dlopen) beside the kernels.
// Decision 0041.  Without it, those formats are widened at load and the startup line says so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "rows.h"

namespace turbospark::kernels {

namespace mx = mlx::core;

// Opens ggml's libraries in `dir` (libggml-base.so and libggml-cpu-<variant>.so): "" where they
// serve, else why not.  The variant follows the kernels' instruction set (ggml_variant).
std::string ggml_open(const std::string& dir);
bool ggml_ready();
// The ggml CPU variant that serves the instruction set in use now ("" where none is loaded).
std::string ggml_variant();
// Bytes of one row of K values of GGUF type `type`, or 0 where ggml has no product for it.
size_t ggml_row_bytes(int type, int K);
std::string ggml_type_name(int type);

// One row's products: y[r * ldy + o] for o in [o0, o1), every row r of x (R x K float32), the
// weights (N rows of `row_bytes`) in GGUF type `type`.  `xq` holds x as ggml_quantize_x wrote it.
void ggml_rows_product(int type, const uint8_t* xq, int R, int K, const uint8_t* w, float* y, int ldy, int o0, int o1);
// x rounded as ggml's products for `type` take it (Q8_K, Q8_0 or Q8_1 rows); returns its bytes.
std::vector<uint8_t> ggml_quantize_x(int type, const float* x, int R, int K);

// x @ dequantize(w).T (+ bias, + residual or swiglu, after the norm): rows.h's rows_matmul for
// weights (N, row_bytes) uint8 in GGUF type `type`.
mx::array rows_ggml_matmul(const mx::array& x, const mx::array& w, int type, int K,
                           const std::optional<mx::array>& bias, const std::optional<mx::array>& residual,
                           int glu, const Prologue& prologue, mx::StreamOrDevice s = {});
// Rows `ids` of a table (V, row_bytes) in GGUF type `type`, as `dtype` (an embedding's lookup).
mx::array ggml_take_rows(const mx::array& table, const mx::array& ids, int type, int K, mx::Dtype dtype,
                         mx::StreamOrDevice s = {});
// float32 (N, K) -> (N, row_bytes) uint8 in `type` (ggml_quantize_chunk), and back: for tests and
// for imports that re-quantize.
mx::array ggml_quantize(const mx::array& values, int type);
mx::array ggml_dequantize(const mx::array& blocks, int type, int K);

// Rows `ids` of Q6_K weights packed for the kernels (rows_k6_matmul's w, highs, fields), as
// `dtype`: a tied embedding's lookup, its head read packed.
mx::array k6_take_rows(const mx::array& w, const mx::array& highs, const mx::array& fields, const mx::array& ids,
                       mx::Dtype dtype, mx::StreamOrDevice s = {});

class K6Rows : public mx::UnaryPrimitive {
 public:
  K6Rows(mx::Stream stream, int K) : mx::UnaryPrimitive(stream), K_(K) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override;
  const char* name() const override { return "TurbosparkK6Rows"; }
  bool is_equivalent(const mx::Primitive& other) const override { return K_ == static_cast<const K6Rows&>(other).K_; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int K_;
};

class GgmlRows : public mx::UnaryPrimitive {
 public:
  GgmlRows(mx::Stream stream, int type, int K) : mx::UnaryPrimitive(stream), type_(type), K_(K) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override;
  const char* name() const override { return "TurbosparkGgmlRows"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int type_;
  int K_;
};

} // namespace turbospark::kernels

// turbospark.kernels._native: the kernels as functions on mx.array (nanobind, in MLX's domain so
// that mlx.core's array type is shared).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/version.h"
#include "fused.h"
#include "ggml_blocks.h"
#include "pool.h"
#include "rows.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace tk = turbospark::kernels;

NB_MODULE(_native, m) {
  m.doc() = "turbospark's CPU kernels for MLX";
  m.attr("mlx_version") = MLX_VERSION_MAJOR * 10000 + MLX_VERSION_MINOR * 100 + MLX_VERSION_PATCH;
  m.def(
      "rows_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, const std::optional<mlx::core::array>& bias,
         const std::optional<mlx::core::array>& residual, bool swiglu, bool geglu, bool gelu, const std::optional<mlx::core::array>& norm,
         float eps) {
        return tk::rows_matmul(x, w, bias, residual, swiglu ? tk::SwiGlu : geglu ? tk::GeGlu : gelu ? tk::Gelu : tk::NoGlu, tk::Prologue{norm, eps});
      },
      "x"_a, "w"_a, "bias"_a = nb::none(), "residual"_a = nb::none(), "swiglu"_a = false, "geglu"_a = false, "gelu"_a = false, "norm"_a = nb::none(),
      "eps"_a = 0.0f,
      "x @ w.T (+ bias) for float weights, on the CPU; then + residual, or swiglu of its two halves.");
  m.def(
      "rows_quantized_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array& scales,
         const mlx::core::array& biases, const std::optional<mlx::core::array>& bias, int group_size, int bits,
         const std::optional<mlx::core::array>& residual, bool swiglu, bool geglu, bool gelu, const std::optional<mlx::core::array>& norm,
         float eps, bool packed) {
        return tk::rows_quantized_matmul(x, w, scales, biases, bias, group_size, bits, residual, swiglu ? tk::SwiGlu : geglu ? tk::GeGlu : gelu ? tk::Gelu : tk::NoGlu,
                                         tk::Prologue{norm, eps}, packed);
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a, "bias"_a = nb::none(), "group_size"_a = 64, "bits"_a = 4,
      "residual"_a = nb::none(), "swiglu"_a = false, "geglu"_a = false, "gelu"_a = false, "norm"_a = nb::none(), "eps"_a = 0.0f, "packed"_a = false,
      "x @ dequantize(w).T (+ bias) for MLX's affine 4- and 8-bit weights, on the CPU; then + residual, or swiglu.\n"
      "packed: weights pack_quantized packed.");
  m.def(
      "rows_ggml_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, int type, int k,
         const std::optional<mlx::core::array>& bias, const std::optional<mlx::core::array>& residual, bool swiglu, bool geglu, bool gelu,
         const std::optional<mlx::core::array>& norm, float eps) {
        return tk::rows_ggml_matmul(x, w, type, k, bias, residual, swiglu ? tk::SwiGlu : geglu ? tk::GeGlu : gelu ? tk::Gelu : tk::NoGlu, tk::Prologue{norm, eps});
      },
      "x"_a, "w"_a, "type"_a, "k"_a, "bias"_a = nb::none(), "residual"_a = nb::none(), "swiglu"_a = false, "geglu"_a = false, "gelu"_a = false,
      "norm"_a = nb::none(), "eps"_a = 0.0f,
      "x @ dequantize(w).T (+ bias) for weights (N, row bytes) in a GGUF block type, through ggml; then + residual, or swiglu.");
  m.def(
      "rows_k4_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array& fields,
         const std::optional<mlx::core::array>& bias, const std::optional<mlx::core::array>& residual, bool swiglu, bool geglu, bool gelu,
         const std::optional<mlx::core::array>& norm, float eps) {
        return tk::rows_k4_matmul(x, w, fields, bias, residual, swiglu ? tk::SwiGlu : geglu ? tk::GeGlu : gelu ? tk::Gelu : tk::NoGlu, tk::Prologue{norm, eps});
      },
      "x"_a, "w"_a, "fields"_a, "bias"_a = nb::none(), "residual"_a = nb::none(), "swiglu"_a = false, "geglu"_a = false, "gelu"_a = false,
      "norm"_a = nb::none(), "eps"_a = 0.0f,
      "x @ W.T (+ bias) for Q4_K super-blocks packed eight rows together (nibbles, fields); then + residual, or swiglu.");
  m.def(
      "rows_k6_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array& highs,
         const mlx::core::array& fields, const std::optional<mlx::core::array>& bias,
         const std::optional<mlx::core::array>& residual, bool swiglu, bool geglu, bool gelu, const std::optional<mlx::core::array>& norm,
         float eps) { return tk::rows_k6_matmul(x, w, highs, fields, bias, residual, swiglu ? tk::SwiGlu : geglu ? tk::GeGlu : gelu ? tk::Gelu : tk::NoGlu, tk::Prologue{norm, eps}); },
      "x"_a, "w"_a, "highs"_a, "fields"_a, "bias"_a = nb::none(), "residual"_a = nb::none(), "swiglu"_a = false, "geglu"_a = false, "gelu"_a = false,
      "norm"_a = nb::none(), "eps"_a = 0.0f,
      "x @ W.T (+ bias) for Q6_K super-blocks packed eight rows together (nibbles, high bits, fields).");
  m.def(
      "rows_k5_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array& highs,
         const mlx::core::array& fields, const std::optional<mlx::core::array>& bias,
         const std::optional<mlx::core::array>& residual, bool swiglu, bool geglu, bool gelu, const std::optional<mlx::core::array>& norm,
         float eps) { return tk::rows_k5_matmul(x, w, highs, fields, bias, residual, swiglu ? tk::SwiGlu : geglu ? tk::GeGlu : gelu ? tk::Gelu : tk::NoGlu, tk::Prologue{norm, eps}); },
      "x"_a, "w"_a, "highs"_a, "fields"_a, "bias"_a = nb::none(), "residual"_a = nb::none(), "swiglu"_a = false, "geglu"_a = false, "gelu"_a = false,
      "norm"_a = nb::none(), "eps"_a = 0.0f,
      "x @ W.T (+ bias) for Q5_0 or Q5_1 blocks packed eight rows together (nibbles, fifth bits, fields).");
  m.def(
      "rows_k5k_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array& highs,
         const mlx::core::array& fields, const std::optional<mlx::core::array>& bias,
         const std::optional<mlx::core::array>& residual, bool swiglu, bool geglu, bool gelu, const std::optional<mlx::core::array>& norm,
         float eps) { return tk::rows_k5k_matmul(x, w, highs, fields, bias, residual, swiglu ? tk::SwiGlu : geglu ? tk::GeGlu : gelu ? tk::Gelu : tk::NoGlu, tk::Prologue{norm, eps}); },
      "x"_a, "w"_a, "highs"_a, "fields"_a, "bias"_a = nb::none(), "residual"_a = nb::none(), "swiglu"_a = false, "geglu"_a = false, "gelu"_a = false,
      "norm"_a = nb::none(), "eps"_a = 0.0f,
      "x @ W.T (+ bias) for Q5_K super-blocks packed eight rows together (nibbles, fifth bits, Q4_K's fields).");
  m.def(
      "k6_take_rows",
      [](const mlx::core::array& w, const mlx::core::array& highs, const mlx::core::array& fields,
         const mlx::core::array& ids, mlx::core::Dtype dtype) { return tk::k6_take_rows(w, highs, fields, ids, dtype); },
      "w"_a, "highs"_a, "fields"_a, "ids"_a, "dtype"_a, "Rows ids of Q6_K weights packed for the kernels, as dtype.");
  m.def("reads_k", &tk::reads_k, "bits"_a, "Whether the instruction set in use reads packed Q4_K (4) or Q6_K (6) as they are.");
  m.def("ggml_open", &tk::ggml_open, "dir"_a, "Open ggml's libraries in dir: '' where they serve, else why not.");
  m.def("ggml_ready", &tk::ggml_ready, "Whether ggml serves the instruction set in use.");
  m.def("ggml_variant", &tk::ggml_variant, "ggml's CPU variant for the instruction set in use.");
  m.def("ggml_row_bytes", &tk::ggml_row_bytes, "type"_a, "k"_a, "Bytes of a row of k values of a GGUF type; 0 where ggml has no product.");
  m.def("ggml_type_name", &tk::ggml_type_name, "type"_a);
  m.def(
      "ggml_take_rows",
      [](const mlx::core::array& table, const mlx::core::array& ids, int type, int k, mlx::core::Dtype dtype) {
        return tk::ggml_take_rows(table, ids, type, k, dtype);
      },
      "table"_a, "ids"_a, "type"_a, "k"_a, "dtype"_a, "Rows ids of a table in a GGUF block type, as dtype.");
  m.def("ggml_quantize", &tk::ggml_quantize, "values"_a, "type"_a, "float (N, K) as (N, row bytes) uint8 of a GGUF type (ggml).");
  m.def("ggml_dequantize", &tk::ggml_dequantize, "blocks"_a, "type"_a, "k"_a, "(N, row bytes) of a GGUF type as float32 (N, k) (ggml).");
  m.def("pack_quantized", &tk::pack_quantized, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "4- or 8-bit weights packed eight output rows together: new (w, scales, biases) of the same shapes.");
  m.def("reads_packed", &tk::reads_packed, "bits"_a,
        "Whether the instruction set in use reads packed weights of `bits` as they are (else it unpacks them each product).");
  m.def(
      "rms_norm",
      [](const mlx::core::array& x, const std::optional<mlx::core::array>& weight, float eps) {
        return tk::rms_norm(x, weight, eps);
      },
      "x"_a, "weight"_a.none(), "eps"_a, "mx.fast.rms_norm as one op on the CPU.");
  m.def("logsumexp", [](const mlx::core::array& x) { return tk::logsumexp(x); }, "x"_a,
        "mx.logsumexp(x, axis=-1, keepdims=True) for float32 x as one op on the CPU, with MLX's bits.");
  m.def(
      "rope",
      [](const mlx::core::array& x, int dims, bool traditional, std::optional<float> base, float scale,
         const mlx::core::array& offset, const std::optional<mlx::core::array>& freqs) {
        return tk::rope(x, dims, traditional, base, scale, offset, freqs);
      },
      "x"_a, "dims"_a, "traditional"_a, "base"_a.none(), "scale"_a, "offset"_a, "freqs"_a = nb::none(),
      "mx.fast.rope as one op on the CPU; offset an int32 array (a scalar or one per batch row).");
  m.def(
      "attention",
      [](const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v, float scale,
         const std::string& mask_mode, const std::optional<mlx::core::array>& mask,
         const std::optional<mlx::core::array>& sinks,
         bool merged) { return tk::attention(q, k, v, scale, mask_mode, mask, sinks, merged); },
      "q"_a, "k"_a, "v"_a, "scale"_a, "mask_mode"_a = "", "mask"_a = nb::none(), "sinks"_a = nb::none(),
      "merged"_a = false,
      "mx.fast.scaled_dot_product_attention as one op on the CPU; merged: (B, L, H * D) out.");
  m.def(
      "kv_write",
      [](const mlx::core::array& keys, const mlx::core::array& values, const mlx::core::array& k,
         const mlx::core::array& v, int at) { return tk::kv_write(keys, values, k, v, at); },
      "keys"_a, "values"_a, "k"_a, "v"_a, "at"_a,
      "A KV cache's write at `at` and read of its first at + L rows, one op: (keys, values, k view, v view).");
  m.def(
      "split_heads", [](const mlx::core::array& qkv, int hq, int hkv) { return tk::split_heads(qkv, hq, hkv); },
      "qkv"_a, "hq"_a, "hkv"_a, "(B, L, (Hq + 2 Hkv) D) as q, k, v in (B, H, L, D): views, one op.");
  m.def("isas", &tk::isas, "The instruction sets this build has and this CPU runs, best first.");
  m.def("isa", &tk::isa, "The instruction set the kernels use.");
  m.def("use_isa", &tk::use_isa, "name"_a, "Use another instruction set (tests); False if not runnable.");
  m.def("activations_in_8_bits", [] { return tk::activations_in_8_bits().load(); },
        "Whether 4-bit products round x to 8 bits per 32 values (where the instruction set can).");
  m.def("x_in_8_bits", &tk::x_in_8_bits, "Whether quantized products round x to 8 bits now (the setting, where the instruction set can).");
  m.def("set_activations_in_8_bits", [](bool on) { tk::activations_in_8_bits().store(on); }, "on"_a,
        "Round x to 8 bits in 4-bit products, or keep it float32 (tests, TURBOSPARK_KERNELS_EXACT).");
  m.def("step_threads", &tk::step_parts, "Threads a decode step's work is split over (the whole team unless set otherwise).");
  m.def("set_step_threads", [](int n) { tk::step_setting().store(n); }, "n"_a,
        "Threads a decode step's work takes: n, or 0 for the whole team (tests, benchmarks).");
  m.def("threads", &tk::threads, "Threads a product is split over.");
  m.def("huge_pages", &tk::huge_pages, "arrays"_a,
        "Back the arrays' memory with transparent huge pages where possible; the bytes that are.");
}

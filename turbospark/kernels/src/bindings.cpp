// turbospark.kernels._native: the kernels as functions on mx.array (nanobind, in MLX's domain so
// that mlx.core's array type is shared).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/version.h"
#include "rows.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace tk = turbospark::kernels;

NB_MODULE(_native, m) {
  m.doc() = "turbospark's CPU kernels for MLX";
  m.attr("mlx_version") = MLX_VERSION_MAJOR * 10000 + MLX_VERSION_MINOR * 100 + MLX_VERSION_PATCH;
  m.def(
      "rows_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, const std::optional<mlx::core::array>& bias) {
        return tk::rows_matmul(x, w, bias);
      },
      "x"_a, "w"_a, "bias"_a = nb::none(), "x @ w.T (+ bias) for float weights, on the CPU.");
  m.def(
      "rows_quantized_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w, const mlx::core::array& scales,
         const mlx::core::array& biases, const std::optional<mlx::core::array>& bias, int group_size, int bits) {
        return tk::rows_quantized_matmul(x, w, scales, biases, bias, group_size, bits);
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a, "bias"_a = nb::none(), "group_size"_a = 64, "bits"_a = 4,
      "x @ dequantize(w).T (+ bias) for MLX's affine 4- and 8-bit weights, on the CPU.");
  m.def("isas", &tk::isas, "The instruction sets this build has and this CPU runs, best first.");
  m.def("isa", &tk::isa, "The instruction set the kernels use.");
  m.def("use_isa", &tk::use_isa, "name"_a, "Use another instruction set (tests); False if not runnable.");
  m.def("threads", &tk::threads, "Threads a product is split over.");
  m.def("huge_pages", &tk::huge_pages, "arrays"_a,
        "Back the arrays' memory with transparent huge pages where possible; the bytes that are.");
}

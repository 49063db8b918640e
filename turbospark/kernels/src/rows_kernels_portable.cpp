// The kernels for any CPU: SSE2 on x86-64, NEON on aarch64 (rows_kernels_impl.h).
#define ROWS_NS portable
#include "rows_kernels_impl.h"

namespace turbospark::kernels {
const Isa& isa_portable() {
#if defined(__aarch64__)
  static const Isa isa{"neon", portable::rows, portable::dots, portable::axpys, portable::dots_h, portable::axpys_h, portable::exps,
                       portable::swiglu, portable::gelus, portable::widen, nullptr, nullptr, nullptr, nullptr, nullptr,
                       nullptr, nullptr, nullptr, portable::dots_b, portable::axpys_b};
#else
  static const Isa isa{"portable", portable::rows, portable::dots, portable::axpys, portable::dots_h, portable::axpys_h, portable::exps,
                       portable::swiglu, portable::gelus, portable::widen, nullptr, nullptr, nullptr, nullptr, nullptr,
                       nullptr, nullptr, nullptr, portable::dots_b, portable::axpys_b};
#endif
  return isa;
}
} // namespace turbospark::kernels

// The kernels for x86-64 with AVX2, FMA and F16C (compiled with -mavx2 -mfma -mf16c; chosen at
// run time only where the CPU has all three).
#define ROWS_NS avx2
#include "rows_kernels_impl.h"

namespace turbospark::kernels {
const Isa& isa_avx2() {
  static const Isa isa{"avx2+fma",     avx2::rows,    avx2::dots,     avx2::axpys,    avx2::dots_h,
                       avx2::axpys_h,  avx2::exps,    avx2::swiglu,   avx2::gelus,    avx2::widen,    avx2::rows_q8,
                       avx2::quantize, avx2::rows_q4p, avx2::rows_q8p, avx2::quantize_packed, avx2::rows_k4p,
                       avx2::rows_k6p,      avx2::rows_k5p, avx2::dots_b, avx2::axpys_b};
  return isa;
}

Isa avx2_with_rows_q8(const char* name, RowsFn rows_q8, RowsFn rows_q4p, RowsFn rows_q8p, RowsFn rows_k4p,
                      RowsFn rows_k6p, RowsFn rows_k5p) {
  Isa isa = isa_avx2();
  isa.name = name;
  isa.rows_q8 = rows_q8;
  isa.rows_q4p = rows_q4p;
  isa.rows_q8p = rows_q8p;
  isa.rows_k4p = rows_k4p;
  isa.rows_k6p = rows_k6p;
  isa.rows_k5p = rows_k5p;
  return isa;
}
} // namespace turbospark::kernels

// The kernels for x86-64 with AVX2, FMA, F16C and AVX-512 VNNI (compiled with -mavx512vnni
// -mavx512vl besides rows_kernels_avx2.cpp's flags; chosen at run time only where the CPU has them
// and runs them).  As in rows_kernels_vnni.cpp, only the 8-bit products differ from the AVX2 set:
// _mm256_dpbusd_epi32 (AVX-512 VNNI's instruction on 256-bit vectors, which CPUs with AVX-512
// VNNI but not AVX-VNNI have, as Cascade Lake, Ice Lake and Zen 4 do) adds the same integer sums
// in the same lanes, so the results are the same bits.
#define ROWS_NS avx512vnni
#include "rows_kernels_impl.h"

namespace turbospark::kernels {
const Isa& isa_avx512vnni() {
  static const Isa isa = avx2_with_rows_q8("avx2+avx512vnni", avx512vnni::rows_q8, avx512vnni::rows_q4p, avx512vnni::rows_q8p, avx512vnni::rows_k4p,
                                                 avx512vnni::rows_k6p, avx512vnni::rows_k5p);
  return isa;
}

// AVX-512 VNNI on 256-bit vectors runs here (tried under a SIGILL handler, as vnni_runs does).
bool avx512vnni_runs() {
  return runs_without_sigill([] {
    volatile int sink = _mm256_extract_epi32(
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(3), _mm256_set1_epi8(-2)), 0);
    (void)sink;
  });
}
} // namespace turbospark::kernels

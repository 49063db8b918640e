// The kernels for x86-64 with AVX2, FMA, F16C and AVX-VNNI (compiled with -mavxvnni besides
// rows_kernels_avx2.cpp's flags; chosen at run time only where the CPU has it and runs it).
// Only the 8-bit products differ from the AVX2 set: _mm256_dpbusd_avx_epi32 does in one
// instruction what two do there, with the same integer sums, so the results are the same bits.
#define ROWS_NS vnni
#include "rows_kernels_impl.h"

namespace turbospark::kernels {
const Isa& isa_vnni() {
  static const Isa isa = avx2_with_rows_q8("avx2+vnni", vnni::rows_q8, vnni::rows_q4p, vnni::rows_q8p, vnni::rows_k4p,
                                                 vnni::rows_k6p, vnni::rows_k5p);
  return isa;
}

// AVX-VNNI runs here: one instruction tried under a SIGILL handler (a CPU flag alone is not
// enough: some virtual machines advertise instructions they do not allow).
bool vnni_runs() {
  return runs_without_sigill([] {
    volatile int sink = _mm256_extract_epi32(
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(3), _mm256_set1_epi8(-2)), 0);
    (void)sink;
  });
}
} // namespace turbospark::kernels

// Packed K-quant rows (rows_kernels.h: K4Fields, K6Fields) dequantized one row at a time, where
// an instruction set cannot read them packed and for an embedding's lookup.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "rows_kernels.h"

namespace turbospark::kernels {

// IEEE half to float, exactly (subnormals included)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(float(mant), -24);
  } else if (exp == 31) {
    v = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    uint32_t bits = ((exp + 112) << 23) | (mant << 13);
    std::memcpy(&v, &bits, sizeof v);
  }
  uint32_t out;
  std::memcpy(&out, &v, sizeof out);
  out |= sign;
  std::memcpy(&v, &out, sizeof v);
  return v;
}

// Row o of packed Q4_K weights as float32 (where the set cannot read them packed): the value
// d * sc * q - dmin * m, with the packed kernel's float32 products.  With `highs`, Q5_K's (q with
// its fifth bit, laid out as k5_row reads them).
inline void k4_row(const uint32_t* w, const K4Fields* fields, int K, int o, float* out,
                   const uint32_t* highs = nullptr) {
  const uint32_t* chunk = w + size_t(o / 8) * K;  // 8 rows x K / 8 words
  const uint32_t* hchunk = highs == nullptr ? nullptr : highs + size_t(o / 8) * K / 4;
  const int lane = o % 8, supers = K / 256;
  for (int b = 0; b < K / 32; ++b) {
    const K4Fields& f = fields[size_t(o / 8) * supers + b / 8];
    const float d = half_to_float(f.d[lane]), dmin = half_to_float(f.dmin[lane]);
    const float scale = d * float(f.sc[b % 8][lane]), bias = -(dmin * float(f.m[b % 8][lane]));
    const uint32_t h = hchunk == nullptr ? 0u : hchunk[size_t(b) * 8 + lane];
    for (int u = 0; u < 4; ++u) {
      const uint32_t word = chunk[size_t(4 * b + u) * 8 + lane];
      for (int n = 0; n < 8; ++n) {
        const uint32_t q = ((word >> (4 * n)) & 15u) | (((h >> (8 * u + n)) & 1u) << 4);
        out[32 * b + 8 * u + n] = scale * float(q) + bias;
      }
    }
  }
}
// Row o of packed Q6_K weights as float32: d * sc * (q - 32) as gguf computes it.
inline void k6_row(const uint32_t* w, const uint32_t* highs, const K6Fields* fields, int K, int o, float* out) {
  const uint32_t* chunk = w + size_t(o / 8) * K;
  const uint32_t* hchunk = highs + size_t(o / 8) * K / 2;
  const int lane = o % 8, supers = K / 256;
  for (int b = 0; b < K / 32; ++b) {
    const K6Fields& f = fields[size_t(o / 8) * supers + b / 8];
    const float d = half_to_float(f.d[lane]);
    for (int u = 0; u < 4; ++u) {
      const uint32_t word = chunk[size_t(4 * b + u) * 8 + lane];
      const uint32_t h = hchunk[size_t(2 * b + u / 2) * 8 + lane] >> (4 * (u % 2));
      const float scale = d * float(f.sc[2 * (b % 8) + u / 2][lane]);
      for (int n = 0; n < 8; ++n) {
        const uint32_t hi = (h >> (8 * (n / 2) + 2 * (n % 2))) & 3u;
        out[32 * b + 8 * u + n] = scale * float(int(((word >> (4 * n)) & 15u) | (hi << 4)) - 32);
      }
    }
  }
}

// Row o of packed Q5_0 or Q5_1 weights as float32: d * q + m.
inline void k5_row(const uint32_t* w, const uint32_t* highs, const K5Fields* fields, int K, int o, float* out) {
  const uint32_t* chunk = w + size_t(o / 8) * K;
  const uint32_t* hchunk = highs + size_t(o / 8) * K / 4;
  const int lane = o % 8;
  for (int b = 0; b < K / 32; ++b) {
    const K5Fields& f = fields[size_t(o / 8) * (K / 32) + b];
    const float d = half_to_float(f.d[lane]), m = half_to_float(f.m[lane]);
    const uint32_t h = hchunk[size_t(b) * 8 + lane];
    for (int u = 0; u < 4; ++u) {
      const uint32_t word = chunk[size_t(4 * b + u) * 8 + lane];
      for (int n = 0; n < 8; ++n) {
        const uint32_t q = ((word >> (4 * n)) & 15u) | (((h >> (8 * u + n)) & 1u) << 4);
        out[32 * b + 8 * u + n] = d * float(q) + m;
      }
    }
  }
}

} // namespace turbospark::kernels

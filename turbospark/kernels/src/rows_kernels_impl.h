// The body of rows_kernels.h's kernels, included once per instruction set by
// rows_kernels_<isa>.cpp with ROWS_NS naming the namespace (see rows_kernels.h).
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "rows_kernels.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace turbospark::kernels::ROWS_NS {

typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef _Float16 v8hf __attribute__((vector_size(16)));
typedef uint8_t v8b __attribute__((vector_size(8)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Eight weights widened to float32.  GCC's generic conversions between element widths come out
// scalar on x86, so AVX2 builds spell them with intrinsics.
inline v8f from_u8(const uint8_t* p) {
#if defined(__AVX2__)
  return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  v8b q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(__builtin_convertvector(q, v8i), v8f);
#endif
}

inline v8f from_bf16(const uint16_t* p) {
#if defined(__AVX2__)
  __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
#else
  v8h h;
  std::memcpy(&h, p, sizeof h);
  return (v8f)(__builtin_convertvector(h, v8u) << 16);
#endif
}

inline v8f from_f16(const uint16_t* p) {
#if defined(__F16C__)
  return (v8f)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  v8hf h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, v8f);
#endif
}

// The eight 4-bit values of one word, the lowest nibble first.
inline v8f from_u4(uint32_t word) {
#if defined(__AVX2__)
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts), _mm256_set1_epi32(15));
  return (v8f)_mm256_cvtepi32_ps(q);
#else
  const v8u shifts = {0, 4, 8, 12, 16, 20, 24, 28};
  v8u q = ((v8u){} + word >> shifts) & 15u;
  return __builtin_convertvector((v8i)q, v8f);
#endif
}

inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// One float16 as float32.  GCC calls libgcc's soft conversion for a scalar _Float16 on x86 even
// with F16C (tens of cycles: it was most of a quantized product's time with float16 scales).
inline float half(const void* p, size_t i) {
#if defined(__F16C__)
  return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
#elif defined(__aarch64__)
  return float(static_cast<const _Float16*>(p)[i]);
#else
  const uint32_t h = static_cast<const uint16_t*>(p)[i];
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400u) == 0);
    bits = sign | (uint32_t(112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

inline float scalar(const void* p, ScaleType t, size_t i) {
  switch (t) {
    case ScaleType::F32:
      return static_cast<const float*>(p)[i];
    case ScaleType::BF16: {
      uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    default:
      return half(p, i);
  }
}

// Weight sources: `span` weights along k share one `Params` (a group's scale and bias), and
// `load` gives 8 consecutive weights of row o as float32.
struct NoParams {};

struct F32Src {
  const float* w;
  size_t K;
  using Params = NoParams;
  int span() const { return int(K); }
  Params params(int, int) const { return {}; }
  v8f load(int o, int k, Params) const { return load8(w + o * K + k); }
};

struct BF16Src {
  const uint16_t* w;
  size_t K;
  using Params = NoParams;
  int span() const { return int(K); }
  Params params(int, int) const { return {}; }
  v8f load(int o, int k, Params) const { return from_bf16(w + o * K + k); }
};

struct F16Src {
  const uint16_t* w;
  size_t K;
  using Params = NoParams;
  int span() const { return int(K); }
  Params params(int, int) const { return {}; }
  v8f load(int o, int k, Params) const { return from_f16(w + o * K + k); }
};

struct Affine {
  float scale;
  float bias;
};

struct AffineSrc {
  const void* scales;
  const void* biases;
  ScaleType stype;
  size_t K;
  int group;
  size_t groups;  // K / group
  using Params = Affine;
  int span() const { return group; }
  // group gi of row o (no division here: it runs once a group)
  Params params(int o, int gi) const {
    size_t i = o * groups + gi;
    return {scalar(scales, stype, i), scalar(biases, stype, i)};
  }
};

struct Affine4Src : AffineSrc {
  const uint32_t* w;
  v8f load(int o, int k, Params p) const { return from_u4(w[(o * K + k) / 8]) * p.scale + p.bias; }
};

struct Affine8Src : AffineSrc {
  const uint8_t* w;
  v8f load(int o, int k, Params p) const { return from_u8(w + o * K + k) * p.scale + p.bias; }
};

// OB output rows (from o) times RB rows of x (from r), each weight vector loaded once.
template <int OB, int RB, class Src>
inline void block(const Src& src, const RowsJob& job, int o, int r, float* y, int ldy, int yo) {
  const int K = job.K;
  const int span = src.span();
  v8f acc[OB][RB] = {};
  for (int g = 0, gi = 0; g < K; g += span, ++gi) {
    typename Src::Params p[OB];
    for (int i = 0; i < OB; ++i) p[i] = src.params(o + i, gi);
    for (int k = g; k < g + span; k += 8) {
      v8f wv[OB];
      for (int i = 0; i < OB; ++i) wv[i] = src.load(o + i, k, p[i]);
      for (int j = 0; j < RB; ++j) {
        v8f xv = load8(job.x + size_t(r + j) * K + k);
        for (int i = 0; i < OB; ++i) acc[i][j] += wv[i] * xv;
      }
    }
  }
  for (int j = 0; j < RB; ++j)
    for (int i = 0; i < OB; ++i) y[size_t(r + j) * ldy + yo + i] = hsum(acc[i][j]);
}

// Output rows [o, o + OB) for every row of x.
template <int OB, class Src>
inline void all_rows(const Src& src, const RowsJob& job, int o, float* y, int ldy, int yo) {
  int r = 0;
  for (; r + 2 <= job.R; r += 2) block<OB, 2>(src, job, o, r, y, ldy, yo);
  if (r < job.R) block<OB, 1>(src, job, o, r, y, ldy, yo);
}

// One row of x times affine weights, the decode case: with w = s * q + b per group,
// sum(w * x) = s * sum(q * x) + b * sum(x), so each group sums q * x and is scaled once, and the
// biases meet the group sums of x.  Per eight weights: widen, convert, one multiply-add.
template <class S>
inline float scale_at(const void* p, size_t i) {
  if constexpr (std::is_same_v<S, float>) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (std::is_same_v<S, uint16_t>) {  // bfloat16
    uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return half(p, i);
  }
}

template <int BITS>
inline v8f raw8(const void* w, size_t at) {  // eight quantized values from weight index `at`
  if constexpr (BITS == 4) {
    return from_u4(static_cast<const uint32_t*>(w)[at / 8]);
  } else {
    return from_u8(static_cast<const uint8_t*>(w) + at);
  }
}

template <int OB, int BITS, class S>
inline void affine_one(const RowsJob& job, const float* xsum, int o) {
  const size_t K = job.K, G = job.group, groups = K / G;
  v8f acc[OB] = {};
  float bias_acc[OB] = {};
  for (size_t gi = 0; gi < groups; ++gi) {
    v8f gacc[OB] = {};
    for (size_t k = gi * G; k < (gi + 1) * G; k += 8) {
      const v8f xv = load8(job.x + k);
      for (int i = 0; i < OB; ++i) gacc[i] += raw8<BITS>(job.w, (o + i) * K + k) * xv;
    }
    for (int i = 0; i < OB; ++i) {
      const size_t at = (o + i) * groups + gi;
      acc[i] += gacc[i] * scale_at<S>(job.scales, at);
      bias_acc[i] += scale_at<S>(job.biases, at) * xsum[gi];
    }
  }
  for (int i = 0; i < OB; ++i) job.y[o + i] = hsum(acc[i]) + bias_acc[i];
}

template <int BITS, class S>
void affine_one_row(const RowsJob& job, int o0, int o1) {
  const int groups = job.K / job.group;
  thread_local std::vector<float> xsum;
  xsum.resize(groups);
  for (int g = 0; g < groups; ++g) {
    float t = 0;
    for (int k = g * job.group; k < (g + 1) * job.group; ++k) t += job.x[k];
    xsum[g] = t;
  }
  int o = o0;
  for (; o + 4 <= o1; o += 4) affine_one<4, BITS, S>(job, xsum.data(), o);
  for (; o < o1; ++o) affine_one<1, BITS, S>(job, xsum.data(), o);
}

template <int BITS>
void affine_one_row(const RowsJob& job, int o0, int o1) {
  switch (job.stype) {
    case ScaleType::F32:
      return affine_one_row<BITS, float>(job, o0, o1);
    case ScaleType::BF16:
      return affine_one_row<BITS, uint16_t>(job, o0, o1);
    default:
      return affine_one_row<BITS, _Float16>(job, o0, o1);
  }
}

template <class Src>
void rows_from(const Src& src, const RowsJob& job, int o0, int o1) {
  constexpr bool is_f32 = std::is_same_v<Src, F32Src>;
  if (is_f32 || job.R <= 2) {  // weights straight from memory
    int o = o0;
    for (; o + 4 <= o1; o += 4) all_rows<4>(src, job, o, job.y, job.N, o);
    for (; o < o1; ++o) all_rows<1>(src, job, o, job.y, job.N, o);
    return;
  }
  // Many rows of x: widen four weight rows into an L1 tile once, then run them as float32.
  thread_local std::vector<float> tile;
  tile.resize(size_t(4) * job.K);
  const F32Src t{tile.data(), size_t(job.K)};
  for (int o = o0; o < o1; o += 4) {
    int ob = std::min(4, o1 - o);
    for (int i = 0; i < ob; ++i)
      for (int g = 0, gi = 0; g < job.K; g += src.span(), ++gi) {
        auto p = src.params(o + i, gi);
        for (int k = g; k < g + src.span(); k += 8) {
          v8f v = src.load(o + i, k, p);
          std::memcpy(tile.data() + size_t(i) * job.K + k, &v, sizeof v);
        }
      }
    // tile row i is output row o + i
    if (ob == 4) {
      all_rows<4>(t, job, 0, job.y + o, job.N, 0);
    } else {
      for (int i = 0; i < ob; ++i) all_rows<1>(t, job, i, job.y + o, job.N, i);
    }
  }
}

void dots(const float* q, const float* k, int64_t kst, int n, int d, float* out) {
  for (int j = 0; j < n; ++j) {
    const float* row = k + j * kst;
    v8f acc0 = {}, acc1 = {};
    int e = 0;
    for (; e + 16 <= d; e += 16) {
      acc0 += load8(q + e) * load8(row + e);
      acc1 += load8(q + e + 8) * load8(row + e + 8);
    }
    for (; e + 8 <= d; e += 8) acc0 += load8(q + e) * load8(row + e);
    float s = hsum(acc0 + acc1);
    for (; e < d; ++e) s += q[e] * row[e];
    out[j] = s;
  }
}

void axpys(const float* p, const float* v, int64_t vst, int n, int d, float* acc) {
  if (d == 64) {  // the usual head size: the sum stays in registers
    v8f a[8];
    for (int e = 0; e < 8; ++e) a[e] = load8(acc + 8 * e);
    for (int j = 0; j < n; ++j) {
      if (p[j] == 0.0f) continue;
      const float* row = v + j * vst;
      for (int e = 0; e < 8; ++e) a[e] += p[j] * load8(row + 8 * e);
    }
    std::memcpy(acc, a, sizeof a);
    return;
  }
  for (int j = 0; j < n; ++j) {
    if (p[j] == 0.0f) continue;
    const float* row = v + j * vst;
    int e = 0;
    for (; e + 8 <= d; e += 8) {
      v8f t = load8(acc + e) + p[j] * load8(row + e);
      std::memcpy(acc + e, &t, sizeof t);
    }
    for (; e < d; ++e) acc[e] += p[j] * row[e];
  }
}

template <class Src>
void widen_from(const Src& src, const RowsJob& job, int o0, int o1, float* out) {
  for (int o = o0; o < o1; ++o)
    for (int g = 0, gi = 0; g < job.K; g += src.span(), ++gi) {
      auto p = src.params(o, gi);
      for (int k = g; k < g + src.span(); k += 8) {
        v8f v = src.load(o, k, p);
        std::memcpy(out + size_t(o - o0) * job.K + k, &v, sizeof v);
      }
    }
}

void widen(const RowsJob& job, int o0, int o1, float* out) {
  const size_t K = job.K;
  switch (job.wtype) {
    case WeightType::F32:
      return widen_from(F32Src{static_cast<const float*>(job.w), K}, job, o0, o1, out);
    case WeightType::BF16:
      return widen_from(BF16Src{static_cast<const uint16_t*>(job.w), K}, job, o0, o1, out);
    case WeightType::F16:
      return widen_from(F16Src{static_cast<const uint16_t*>(job.w), K}, job, o0, o1, out);
    case WeightType::Affine4:
      return widen_from(Affine4Src{{job.scales, job.biases, job.stype, K, job.group, K / job.group},
                                   static_cast<const uint32_t*>(job.w)}, job, o0, o1, out);
    case WeightType::Affine8:
      return widen_from(Affine8Src{{job.scales, job.biases, job.stype, K, job.group, K / job.group},
                                   static_cast<const uint8_t*>(job.w)}, job, o0, o1, out);
  }
}

void rows(const RowsJob& job, int o0, int o1) {
  const size_t K = job.K;
  switch (job.wtype) {
    case WeightType::F32:
      return rows_from(F32Src{static_cast<const float*>(job.w), K}, job, o0, o1);
    case WeightType::BF16:
      return rows_from(BF16Src{static_cast<const uint16_t*>(job.w), K}, job, o0, o1);
    case WeightType::F16:
      return rows_from(F16Src{static_cast<const uint16_t*>(job.w), K}, job, o0, o1);
    case WeightType::Affine4: {
      if (job.R == 1) return affine_one_row<4>(job, o0, o1);
      Affine4Src s{{job.scales, job.biases, job.stype, K, job.group, K / job.group}, static_cast<const uint32_t*>(job.w)};
      return rows_from(s, job, o0, o1);
    }
    case WeightType::Affine8: {
      if (job.R == 1) return affine_one_row<8>(job, o0, o1);
      Affine8Src s{{job.scales, job.biases, job.stype, K, job.group, K / job.group}, static_cast<const uint8_t*>(job.w)};
      return rows_from(s, job, o0, o1);
    }
  }
}

} // namespace turbospark::kernels::ROWS_NS

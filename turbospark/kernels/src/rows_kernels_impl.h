// The body of rows_kernels.h's kernels, included once per instruction set by
// rows_kernels_<isa>.cpp with ROWS_NS naming the namespace (see rows_kernels.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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

// the order of _mm256_hadd_ps over four rows (q8_block), so a row's sum is the same bits
// whether it was reduced alone or with three others
inline float hsum_pairs(v8f v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

inline float hsum_max(v8f v) {
  return std::max(std::max(std::max(v[0], v[4]), std::max(v[1], v[5])), std::max(std::max(v[2], v[6]), std::max(v[3], v[7])));
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

// fn(S{}) with S the C++ type of a scale type (bfloat16 as its uint16_t bits)
template <class Fn>
inline void by_scale_type(ScaleType t, Fn&& fn) {
  switch (t) {
    case ScaleType::F32:
      return fn(float{});
    case ScaleType::BF16:
      return fn(uint16_t{});
    default:
      return fn(_Float16{});
  }
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
  by_scale_type(job.stype, [&](auto s) { affine_one_row<BITS, decltype(s)>(job, o0, o1); });
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

// Eight sums at once: lane i of the result is the sum of a[i]'s eight lanes.
inline v8f hsum8(const v8f* a) {
#if defined(__AVX2__)
  const __m256 t0 = _mm256_hadd_ps(__m256(a[0]), __m256(a[1])), t1 = _mm256_hadd_ps(__m256(a[2]), __m256(a[3]));
  const __m256 t2 = _mm256_hadd_ps(__m256(a[4]), __m256(a[5])), t3 = _mm256_hadd_ps(__m256(a[6]), __m256(a[7]));
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // a0..a3 and a4..a7, per 128-bit half
  return v8f(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
  v8f out;
  for (int i = 0; i < 8; ++i) out[i] = hsum_pairs(a[i]);
  return out;
#endif
}

// MLX's own exp on the CPU (mlx/backend/cpu/simd/math.h: Cephes' polynomial for 2^fraction),
// x[i] = exp(x[i]) for n values in place, eight at a time where the set has FMA: the same bits
// as MLX's (its products and sums rounded one by one, hence no contraction here).
__attribute__((optimize("fp-contract=off"))) void exps(float* x, int n) {
  int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 c1 = _mm256_set1_ps(1.442695f), half = _mm256_set1_ps(0.5f);
  const __m256 hi = _mm256_set1_ps(88.0f), lo = _mm256_set1_ps(-88.0f);
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  for (; i + 8 <= n; i += 8) {
    const __m256 x0 = _mm256_loadu_ps(x + i);
    const __m256 t = _mm256_mul_ps(x0, c1);
    const __m256 ip = _mm256_floor_ps(_mm256_add_ps(t, half));
    const __m256 f = _mm256_sub_ps(t, ip);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ip), _mm256_set1_epi32(127)), 23);
    __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(e), p);
    r = _mm256_blendv_ps(r, inf, _mm256_cmp_ps(x0, hi, _CMP_GT_OQ));
    r = _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(x0, lo, _CMP_LT_OQ));
    r = _mm256_blendv_ps(r, x0, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
    _mm256_storeu_ps(x + i, r);
  }
#endif
  for (; i < n; ++i) {
    const float x0 = x[i];
    if (std::isnan(x0)) continue;
    if (x0 > 88.0f) {
      x[i] = std::numeric_limits<float>::infinity();
      continue;
    }
    if (x0 < -88.0f) {
      x[i] = 0.0f;
      continue;
    }
    const float t = x0 * 1.442695f;
    const float ip = std::floor(t + 0.5f);
    const float f = t - ip;
    float p = 1.535336188319500e-4f;
    p = std::fma(p, f, 1.339887440266574e-3f);
    p = std::fma(p, f, 9.618437357674640e-3f);
    p = std::fma(p, f, 5.550332471162809e-2f);
    p = std::fma(p, f, 2.402264791363012e-1f);
    p = std::fma(p, f, 6.931472028550421e-1f);
    p = std::fma(p, f, 1.0f);
    const int32_t bits = (int32_t(ip) + 127) << 23;
    float two;
    std::memcpy(&two, &bits, sizeof two);
    x[i] = two * p;
  }
}

// nn.gelu(y) = y (1 + erf(y / sqrt 2)) / 2: with z = |y| / sqrt 2, t = 1 / (1 + p z) and
// q = poly(t) exp(-z^2) (Abramowitz and Stegun 7.1.26, |error| < 1.5e-7), 1 + erf is q for y < 0
// and 2 - q for y >= 0; loops the compiler vectorizes for the instruction set
void gelus(const float* y, float* out, float* scratch, int n) {
  for (int i = 0; i < n; ++i) {
    const float z = std::fabs(y[i]) * 0.70710678118654752f;
    scratch[i] = -z * z;
  }
  exps(scratch, n);
  int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
  const __m256 sign = _mm256_set1_ps(-0.0f), c = _mm256_set1_ps(0.70710678118654752f), p = _mm256_set1_ps(0.3275911f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(y + i);
    const __m256 u = _mm256_div_ps(one, _mm256_fmadd_ps(p, _mm256_mul_ps(_mm256_andnot_ps(sign, g), c), one));
    __m256 t = _mm256_fmadd_ps(_mm256_set1_ps(1.061405429f), u, _mm256_set1_ps(-1.453152027f));
    t = _mm256_fmadd_ps(t, u, _mm256_set1_ps(1.421413741f));
    t = _mm256_fmadd_ps(t, u, _mm256_set1_ps(-0.284496736f));
    t = _mm256_fmadd_ps(t, u, _mm256_set1_ps(0.254829592f));
    const __m256 q = _mm256_mul_ps(_mm256_mul_ps(t, u), _mm256_loadu_ps(scratch + i));
    const __m256 w = _mm256_blendv_ps(q, _mm256_sub_ps(two, q), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(half, g), w));
  }
#endif
  for (; i < n; ++i) {
    const float g = y[i], u = 1.0f / (1.0f + 0.3275911f * (std::fabs(g) * 0.70710678118654752f));
    const float q =
        u * (0.254829592f + u * (-0.284496736f + u * (1.421413741f + u * (-1.453152027f + u * 1.061405429f)))) * scratch[i];
    out[i] = 0.5f * g * (g >= 0 ? 2.0f - q : q);
  }
}

void swiglu(const float* gate, const float* up, float* out, float* scratch, int n) {
  for (int i = 0; i < n; ++i) scratch[i] = std::fabs(gate[i]);
  exps(scratch, n);
  int i = 0;
#if defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, _mm256_loadu_ps(scratch + i)));
    const __m256 sig = _mm256_blendv_ps(_mm256_sub_ps(one, s), s, _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = gate[i], s = 1.0f / (1.0f + scratch[i]);
    out[i] = (g * (g < 0 ? s : 1.0f - s)) * up[i];
  }
}

// A key or value row's eight values from e as float32: float32 rows as they are, float16 rows
// (a KV cache held in half precision) widened exactly.
inline v8f row8(const float* p) { return load8(p); }
inline v8f row8(const uint16_t* p) { return from_f16(p); }
inline float row1(const float* p, int e) { return p[e]; }
inline float row1(const uint16_t* p, int e) { return half(p, e); }

// Eight values of a KV cache row held in blocks of 32 (F 1: q8_0, F 2: q4_0; Isa::dots_b) from
// value e (a multiple of 8), widened to float32: the integers times their block's float16 scale.
template <int F>
inline v8f block8(const uint8_t* row, int e) {
  constexpr int kBytes = F == 1 ? 34 : 18;
  const uint8_t* blk = row + (e >> 5) * kBytes;
  const int o = e & 31;
  uint16_t h;
  std::memcpy(&h, blk, sizeof h);
  v8f x;
#if defined(__AVX2__)
  if constexpr (F == 1) {
    x = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + o))));
  } else {
    __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + (o & 15)));
    if (o >= 16) raw = _mm_srli_epi16(raw, 4);
    raw = _mm_and_si128(raw, _mm_set1_epi8(15));
    x = (v8f)_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(raw), _mm256_set1_epi32(8)));
  }
#else
  alignas(32) float t[8];
  for (int i = 0; i < 8; ++i) {
    t[i] = F == 1 ? float(static_cast<int8_t>(blk[2 + o + i])) : float(int((blk[2 + (o & 15) + i] >> (o >= 16 ? 4 : 0)) & 15) - 8);
  }
  x = load8(t);
#endif
  return x * half(&h, 0);
}

// Value e of a KV cache row held in blocks (F as for block8), alone.
template <int F>
inline float block1(const uint8_t* row, int e) {
  const uint8_t* blk = row + (e >> 5) * (F == 1 ? 34 : 18);
  const int o = e & 31;
  const float q = F == 1 ? float(static_cast<int8_t>(blk[2 + o])) : float(int((blk[2 + (o & 15)] >> (o >= 16 ? 4 : 0)) & 15) - 8);
  uint16_t h;
  std::memcpy(&h, blk, sizeof h);
  return q * half(&h, 0);
}

// A row's eight values from e, and its value e: F 0 for float32 and float16 rows (E their type),
// 1 or 2 for rows in blocks (E uint8_t).
template <int F, class E>
inline v8f values8(const E* row, int e) {
  if constexpr (F == 0) return row8(row + e);
  else return block8<F>(row, e);
}

template <int F, class E>
inline float value1(const E* row, int e) {
  if constexpr (F == 0) return row1(row, e);
  else return block1<F>(row, e);
}

// The scores of G query heads that share their keys (grouped-query attention), each key row
// read from memory once for all of them: out[g * ost + j] = sum_e q[g * qst + e] * k[j * kst + e].
// Eight keys at a time (one sum each, reduced together); d a multiple of 8 takes the vector path.
// E: the keys' type (float, or float16's bits, or a quantized cache's bytes with F its blocks'
// kind); the sums are the same bits either way for the same float32 values.
template <class E, int F = 0>
void dots_of(const float* q, int G, int64_t qst, const E* k, int64_t kst, int n, int d, float* out, int64_t ost) {
  int j = 0;
  if (d % 8 == 0) {
    for (; j + 8 <= n; j += 8) {
      const E* kj = k + j * kst;
      for (int g = 0; g < G; ++g) {  // the eight key rows stay in L1 across the heads
        const float* qg = q + g * qst;
        v8f acc[8] = {};
        for (int e = 0; e < d; e += 8) {
          const v8f qv = load8(qg + e);
          for (int t = 0; t < 8; ++t) acc[t] += qv * values8<F>(kj + t * kst, e);
        }
        const v8f sums = hsum8(acc);
        std::memcpy(out + g * ost + j, &sums, sizeof sums);
      }
    }
  }
  for (; j < n; ++j) {
    const E* row = k + j * kst;
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * qst;
      v8f acc = {};
      int e = 0;
      for (; e + 8 <= d; e += 8) acc += load8(qg + e) * values8<F>(row, e);
      float s = hsum_pairs(acc);
      for (; e < d; ++e) s = std::fma(qg[e], value1<F>(row, e), s);  // one rounding whatever the build contracts
      out[g * ost + j] = s;
    }
  }
}

void dots(const float* q, int G, int64_t qst, const float* k, int64_t kst, int n, int d, float* out, int64_t ost) {
  dots_of(q, G, qst, k, kst, n, d, out, ost);
}

void dots_h(const float* q, int G, int64_t qst, const uint16_t* k, int64_t kst, int n, int d, float* out, int64_t ost) {
  dots_of(q, G, qst, k, kst, n, d, out, ost);
}

// acc[g * ast + e] += sum_j p[g * pst + j] * v[j * vst + e] for the G heads that share the values,
// a block of value rows at a time (kept in L1 while each head's sum passes over it; rows whose
// p is 0 skipped).  E and F: the values' type, as for dots_of.
template <class E, int F = 0>
void axpys_of(const float* p, int G, int64_t pst, const E* v, int64_t vst, int n, int d, float* acc, int64_t ast) {
  constexpr int kBlock = 32;
  for (int j0 = 0; j0 < n; j0 += kBlock) {
    const int j1 = std::min(n, j0 + kBlock);
    for (int g = 0; g < G; ++g) {
      const float* pg = p + g * pst;
      float* ag = acc + g * ast;
      if (d == 64) {  // the usual head size: the sum stays in registers
        v8f a[8];
        for (int e = 0; e < 8; ++e) a[e] = load8(ag + 8 * e);
        for (int j = j0; j < j1; ++j) {
          if (pg[j] == 0.0f) continue;
          const E* row = v + j * vst;
          for (int e = 0; e < 8; ++e) a[e] += pg[j] * values8<F>(row, 8 * e);
        }
        std::memcpy(ag, a, sizeof a);
        continue;
      }
      for (int j = j0; j < j1; ++j) {
        if (pg[j] == 0.0f) continue;
        const E* row = v + j * vst;
        int e = 0;
        for (; e + 8 <= d; e += 8) {
          v8f t = load8(ag + e) + pg[j] * values8<F>(row, e);
          std::memcpy(ag + e, &t, sizeof t);
        }
        for (; e < d; ++e) ag[e] = std::fma(pg[j], value1<F>(row, e), ag[e]);
      }
    }
  }
}

void axpys(const float* p, int G, int64_t pst, const float* v, int64_t vst, int n, int d, float* acc, int64_t ast) {
  axpys_of(p, G, pst, v, vst, n, d, acc, ast);
}

void axpys_h(const float* p, int G, int64_t pst, const uint16_t* v, int64_t vst, int n, int d, float* acc, int64_t ast) {
  axpys_of(p, G, pst, v, vst, n, d, acc, ast);
}

// dots and axpys over rows held in blocks (Isa::dots_b): each value widened as it is read.
void dots_b(int fmt, const float* q, int G, int64_t qst, const uint8_t* k, int64_t kst, int n, int d, float* out,
            int64_t ost) {
  if (fmt == 1) return dots_of<uint8_t, 1>(q, G, qst, k, kst, n, d, out, ost);
  dots_of<uint8_t, 2>(q, G, qst, k, kst, n, d, out, ost);
}

void axpys_b(int fmt, const float* p, int G, int64_t pst, const uint8_t* v, int64_t vst, int n, int d, float* acc,
             int64_t ast) {
  if (fmt == 1) return axpys_of<uint8_t, 1>(p, G, pst, v, vst, n, d, acc, ast);
  axpys_of<uint8_t, 2>(p, G, pst, v, vst, n, d, acc, ast);
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

#if defined(__AVX2__)
// --- 4-bit weights times 8-bit activations ------------------------------------------------------
//
// Each 32 values of a row of x are rounded to int8 with a scale d = max|x| / 127 (llama.cpp's
// Q8_0).  MLX packs weight k in nibble k % 8 of word k / 8, so byte j of a row holds weights 2j
// (low nibble) and 2j + 1 (high nibble): with x's even values beside the low nibbles and its odd
// ones beside the high nibbles, one _mm256_maddubs_epi16 multiplies 32 weights by their 32 values
// and adds them in pairs.  With w = s * q + b per group,
//   y = sum over 32s of d * s * sum(q * x8)  +  sum over groups of b * sum(x)
// the first term 64 weights at a time (lanes 0-3: the first 32, lanes 4-7: the next), the second
// a dot product of the row's biases with the groups' exact float sums of x.

// Two sets of 32 unsigned bytes times their 32 signed ones, each four adjacent products summed
// into one int32 lane: lane l holds sum over b in 4l..4l+3 of u0[b] * s0[b] + u1[b] * s1[b].  No
// product pair here reaches int16's bounds (15 * 127 or 128 * 127, twice), so AVX2's
// _mm256_maddubs_epi16, AVX-VNNI's _mm256_dpbusd_avx_epi32 and AVX-512 VNNI's _mm256_dpbusd_epi32
// give the same integers.
inline __m256i dot_u8s8x2(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                           _mm256_set1_epi16(1));
#endif
}

// one set: lane l holds sum over b in 4l..4l+3 of u[b] * s[b]
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// hsum_pairs of four sums at once, into out[0..3]: _mm256_hadd_ps pairs the lanes in its order
inline void store_sums4(float* out, __m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_store_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

inline int hsum_i32(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

// 32 values of x rounded to int8 with the scale m / 127 (m = max |x|), in order, as llama.cpp's
// Q8_1 rounds them; into `sum` the rounded values' sum times that scale (Q8_1's s), which the
// weights' biases meet: a product then reads x's rounded values alone, so the rounding moves an
// output by sum(w * e) (e: each value's rounding), as llama.cpp's does, not by sum(s * q * e),
// which for MLX's affine weights (q from 0, the bias bringing it back) is about twice as much for
// 4-bit weights and some 64 times for 8-bit ones
inline __m256i round32(const float* c, float& m, float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(c + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  m = hsum_max(amax);
  const __m256 inv = _mm256_set1_ps(m > 0 ? 127.0f / m : 0.0f);
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], inv));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], inv));
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), b);  // |sum of two| <= 254: no saturation
  sum = (m / 127.0f) * float(hsum_i32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1))));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

void quantize(const float* x, int R, int K, int G, bool pairs, int8_t* x8, float* d8, float* xsg, float* usg) {
  std::fill(xsg, xsg + size_t(R) * (K / G), 0.0f);
  if (!pairs) std::fill(usg, usg + size_t(R) * (K / G), 0.0f);
  // within each 16 bytes: the 8 even bytes, then the 8 odd ones
  const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                              0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < K; k += 32) {
      const size_t at = size_t(r) * K + k;
      float m, sum;
      __m256i b = round32(x + at, m, sum);
      const int half = (k / 32) % 2;              // where these 32 go in their 64
      // each 64's eight scales: 4-bit weights d0 d0 d0 d0 d1 d1 d1 d1 (q8_block's lanes), 8-bit
      // weights d0 d0 d1 d1 d0 d0 d1 d1 (q8_block8's)
      for (int i = 0; i < 4; ++i) d8[(at - 32 * half) / 8 + (pairs ? 4 * half + i : 2 * half + i % 2 + 4 * (i / 2))] = m / 127.0f;
      const size_t g = size_t(r) * (K / G) + k / G;
      xsg[g] += sum;
      if (!pairs) {  // 8-bit weights: 128 * d * sum(x8) per group (q8_block8)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(x8 + at), b);
        const __m256i s16 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), b), _mm256_set1_epi16(1));
        usg[g] += 128.0f * (m / 127.0f) * float(hsum_i32(s16));
        continue;
      }
      b = _mm256_shuffle_epi8(b, evens_odds);     // per 16: evens, odds
      b = _mm256_permute4x64_epi64(b, 0xD8);      // evens of all 32, then odds
      int8_t* out = x8 + at - 32 * half;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * half), _mm256_castsi256_si128(b));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 + 16 * half), _mm256_extracti128_si256(b, 1));
    }
  }
}

// two scales (float32, bfloat16 as uint16_t, or float16) from index `at`, in lanes 0 and 1
template <class S>
inline __m128 two_at(const void* p, size_t at) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(static_cast<const float*>(p) + at)));
  } else {
    uint32_t bits;
    std::memcpy(&bits, static_cast<const uint16_t*>(p) + at, sizeof bits);
    const __m128i h = _mm_cvtsi32_si128(int(bits));
    if constexpr (std::is_same_v<S, uint16_t>) return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
    else return _mm_cvtph_ps(h);
  }
}

// eight scales from index `at`
template <class S>
inline __m256 eight_at(const void* p, size_t at) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + at);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + at));
    if constexpr (std::is_same_v<S, uint16_t>) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }
}

// the scales of the 32 weights at k (lanes 0-3) and of the 32 after them (lanes 4-7)
template <class S>
inline __m256 scale_pair(const void* p, size_t row_at, int k, int G) {
  if (G == 32)
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two_at<S>(p, row_at + k / 32)), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  return _mm256_set1_ps(scale_at<S>(p, row_at + k / G));
}

// sum over groups of bias * sum(x), as eight lanes (added to a row's sum before it is reduced),
// for RB rows of x (their group sums `groups` apart) at once, each row's the same bits as alone:
// the biases are read and widened once for all of them
template <int RB, class S>
inline void bias_terms(const void* biases, size_t row_at, const float* xsg, int groups, __m256* out) {
  __m256 acc[RB];
  float rest[RB];
  for (int j = 0; j < RB; ++j) acc[j] = _mm256_setzero_ps(), rest[j] = 0;
  int g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 b = eight_at<S>(biases, row_at + g);
    for (int j = 0; j < RB; ++j) acc[j] = _mm256_fmadd_ps(b, _mm256_loadu_ps(xsg + size_t(j) * groups + g), acc[j]);
  }
  for (; g < groups; ++g) {
    const float b = scale_at<S>(biases, row_at + g);
    for (int j = 0; j < RB; ++j) rest[j] += b * xsg[size_t(j) * groups + g];
  }
  for (int j = 0; j < RB; ++j) out[j] = _mm256_add_ps(acc[j], _mm256_setr_ps(rest[j], 0, 0, 0, 0, 0, 0, 0));
}

// a block's OB x RB sums reduced into y (output rows o.., rows r.. of x), four at a time where
// they line up, each in hsum_pairs' order: the same bits however the block was shaped
template <int OB, int RB>
inline void store_block(const RowsJob& job, const __m256 (&acc)[OB][RB], int o, int r) {
  if constexpr (OB == 1 && RB % 4 == 0) {  // four rows of x beside one output row
    for (int j0 = 0; j0 < RB; j0 += 4) {
      alignas(16) float t4[4];
      store_sums4(t4, acc[0][j0], acc[0][j0 + 1], acc[0][j0 + 2], acc[0][j0 + 3]);
      for (int j = 0; j < 4; ++j) job.y[size_t(r + j0 + j) * job.N + o] = t4[j];
    }
  } else {
    for (int j = 0; j < RB; ++j) {
      float* y = job.y + size_t(r + j) * job.N + o;
      if constexpr (OB == 4) {  // four output rows beside one row of x, stored as they come
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][j], acc[1][j]), _mm256_hadd_ps(acc[2][j], acc[3][j]));
        _mm_storeu_ps(y, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
      } else {
        for (int i = 0; i < OB; ++i) y[i] = hsum_pairs(v8f(acc[i][j]));
      }
    }
  }
}

// output rows o .. o + OB - 1 for rows r .. r + RB - 1 of x; OB * RB independent sums, so the
// multiply-adds of one step do not wait on each other
template <int OB, int RB, class S>
inline void q8_block(const RowsJob& job, const float* xsg, int o, int r) {
  const int K = job.K, G = job.group, groups = K / G;
  const int8_t* x8 = job.x8 + size_t(r) * K;     // x's rows r.. in 8 bits
  const float* d8 = job.d8 + size_t(r) * (K / 8);  // and their scales
  const __m256i m4 = _mm256_set1_epi8(15);
  __m256 acc[OB][RB];
  for (int i = 0; i < OB; ++i)
    for (int j = 0; j < RB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 64) {
    for (int i = 0; i < OB; ++i) {
      const uint8_t* w = static_cast<const uint8_t*>(job.w) + (size_t(o + i) * K + k) / 2;
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i lo = _mm256_and_si256(packed, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), m4);
      const __m256 s = scale_pair<S>(job.scales, size_t(o + i) * groups, k, G);
      for (int j = 0; j < RB; ++j) {
        const int8_t* xj = x8 + size_t(j) * K + k;
        const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj));
        const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj + 32));
        const __m256 p = _mm256_cvtepi32_ps(dot_u8s8x2(lo, xe, hi, xo));
        acc[i][j] = _mm256_fmadd_ps(p, _mm256_mul_ps(s, _mm256_loadu_ps(d8 + size_t(j) * (K / 8) + k / 8)), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < OB; ++i) {
    __m256 b[RB];
    bias_terms<RB, S>(job.biases, size_t(o + i) * groups, xsg + size_t(r) * groups, groups, b);
    for (int j = 0; j < RB; ++j) acc[i][j] = _mm256_add_ps(acc[i][j], b[j]);
  }
  store_block<OB, RB>(job, acc, o, r);
}

// 8-bit weights q in 0..255 times x8: q - 128 fits int8, and _mm256_maddubs_epi16 takes
// |q - 128| unsigned beside x8 with (q - 128)'s sign (at most 2 * 128 * 127, no saturation), so
//   y = sum over 32s of d * s * (sum((q - 128) * x8) + 128 * sum(x8))  +  sum over groups of b * sum(x)
// the 128 * sum(x8) part joining the bias terms as a dot product of the row's scales.  x8 is in
// its own order here.  Two 32s at a time: their eight sums of four products each are paired up
// (_mm256_hadd_epi32: lanes 0, 1, 4, 5 the first 32's, 2, 3, 6, 7 the second's), so one
// conversion and one multiply-add serve 64 weights, against d8's d0 d0 d1 d1 d0 d0 d1 d1.

// the scales of the 32 weights at k and of the 32 after them, in hadd_epi32's lanes
template <class S>
inline __m256 scale_pair8(const void* p, size_t row_at, int k, int G) {
  if (G == 32)
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two_at<S>(p, row_at + k / 32)), _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1));
  return _mm256_set1_ps(scale_at<S>(p, row_at + k / G));
}

template <int OB, int RB, class S>
inline void q8_block8(const RowsJob& job, const float* xsg, const float* usg, int o, int r) {
  const int K = job.K, G = job.group, groups = K / G;
  const int8_t* x8 = job.x8 + size_t(r) * K;
  const float* d8 = job.d8 + size_t(r) * (K / 8);
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  __m256 acc[OB][RB];
  for (int i = 0; i < OB; ++i)
    for (int j = 0; j < RB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 64) {
    for (int i = 0; i < OB; ++i) {
      const uint8_t* w = static_cast<const uint8_t*>(job.w) + size_t(o + i) * K + k;
      const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), flip);
      const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)), flip);
      const __m256i size0 = _mm256_abs_epi8(q0), size1 = _mm256_abs_epi8(q1);  // -128 gives 0x80: 128 unsigned
      const __m256 s = scale_pair8<S>(job.scales, size_t(o + i) * groups, k, G);
      for (int j = 0; j < RB; ++j) {
        const int8_t* xj = x8 + size_t(j) * K + k;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj + 32));
        const __m256i p0 = dot_u8s8(size0, _mm256_sign_epi8(x0, q0));
        const __m256i p1 = dot_u8s8(size1, _mm256_sign_epi8(x1, q1));
        const __m256 p = _mm256_cvtepi32_ps(_mm256_hadd_epi32(p0, p1));
        acc[i][j] = _mm256_fmadd_ps(p, _mm256_mul_ps(s, _mm256_loadu_ps(d8 + size_t(j) * (K / 8) + k / 8)), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < OB; ++i) {
    __m256 b[RB], u[RB];
    const size_t row_at = size_t(o + i) * groups, x_at = size_t(r) * groups;
    bias_terms<RB, S>(job.biases, row_at, xsg + x_at, groups, b);
    bias_terms<RB, S>(job.scales, row_at, usg + x_at, groups, u);
    for (int j = 0; j < RB; ++j) acc[i][j] = _mm256_add_ps(acc[i][j], _mm256_add_ps(b[j], u[j]));
  }
  store_block<OB, RB>(job, acc, o, r);
}

template <int BITS, int OB, int RB, class S>
inline void q8_any(const RowsJob& job, const float* xsg, const float* usg, int o, int r) {
  if constexpr (BITS == 4) q8_block<OB, RB, S>(job, xsg, o, r);
  else q8_block8<OB, RB, S>(job, xsg, usg, o, r);
}

// rows of x a block takes beside one output row, where there are that many: their sums, the
// row's weights and the temporaries fit AVX-512's 32 vector registers eight rows at a time
#if defined(__AVX512VL__)
constexpr int WIDE_RB = 8;
#else
constexpr int WIDE_RB = 4;
#endif

template <int BITS, class S>
void rows_q8_typed(const RowsJob& job, int o0, int o1) {
  const float *xsg = job.xsg, *usg = job.usg;
  if (job.R == 1) {
    int o = o0;
    for (; o + 4 <= o1; o += 4) q8_any<BITS, 4, 1, S>(job, xsg, usg, o, 0);
    for (; o < o1; ++o) q8_any<BITS, 1, 1, S>(job, xsg, usg, o, 0);
    return;
  }
  // 16 rows of x at a time (their 8-bit values and scales stay in L1) against every output row
  for (int r0 = 0; r0 < job.R; r0 += 16) {
    const int r1 = std::min(job.R, r0 + 16);
    for (int o = o0; o < o1; ++o) {
      int r = r0;
      for (; r + WIDE_RB <= r1; r += WIDE_RB) q8_any<BITS, 1, WIDE_RB, S>(job, xsg, usg, o, r);
      for (; r + 4 <= r1; r += 4) q8_any<BITS, 1, 4, S>(job, xsg, usg, o, r);
      switch (r1 - r) {
        case 3: q8_any<BITS, 1, 3, S>(job, xsg, usg, o, r); break;
        case 2: q8_any<BITS, 1, 2, S>(job, xsg, usg, o, r); break;
        case 1: q8_any<BITS, 1, 1, S>(job, xsg, usg, o, r); break;
      }
    }
  }
}

void rows_q8(const RowsJob& job, int o0, int o1) {
  by_scale_type(job.stype, [&](auto s) {
    if (job.wtype == WeightType::Affine8) rows_q8_typed<8, decltype(s)>(job, o0, o1);
    else rows_q8_typed<4, decltype(s)>(job, o0, o1);
  });
}

// --- 4- and 8-bit weights packed eight output rows together (pack_q, rows_kernels.h) ------------
//
// Lane i of a vector is output row o + i.  8-bit weights: dword t of the rows' 32 weights is one
// load, their weights 4t .. 4t + 3.  4-bit weights: dword u (u = 0..3) of the rows' 16 packed
// bytes is one load, its low nibbles the weights 8u, 8u + 2, 8u + 4, 8u + 6 and its high nibbles
// 8u + 1, 8u + 3, 8u + 5, 8u + 7.  x's four values beside each set are one int32, broadcast, so
// one dpbusd (AVX2: maddubs and madd) adds four products to each row's integer sum of the 32;
// each 32's sum is then scaled by the rows' scales (one vector, read once for every row of x)
// times x's, and each group's biases meet x's group sums.  No horizontal sums: the eight results
// are stored as they are.  A row of x and an output row meet in lane order, one 32 at a time,
// whatever else is in the product: the same bits for any number of rows and threads.

// x as `quantize` rounds it (the same values and scales), in order, or for 4-bit weights
// (`pairs`) each 8 values as their 4 even then 4 odd ones; each 32's scale (R x K/32), each
// group's sum of x as rounded (R x K/G) and, where xs8 is given, each 32's sum of x8 (R x K/32)
void quantize_packed(const float* x, int R, int K, int G, bool pairs, int8_t* x8, float* d32, float* xsg,
                     int32_t* xs8) {
  std::fill(xsg, xsg + size_t(R) * (K / G), 0.0f);
  const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                              0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < K; k += 32) {
      const size_t at = size_t(r) * K + k;
      float m, sum;
      __m256i b = round32(x + at, m, sum);
      if (pairs) b = _mm256_shuffle_epi8(b, evens_odds);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x8 + at), b);
      if (xs8 != nullptr) xs8[at / 32] = hsum_i32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), b), _mm256_set1_epi16(1)));
      d32[at / 32] = m / 127.0f;
      xsg[size_t(r) * (K / G) + k / G] += sum;
    }
  }
}

// acc + each lane's four products of u and s (unsigned by signed bytes: 4-bit weights' pairs
// stay far from int16's bounds in AVX2's maddubs, dot_u8s8x2)
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, dot_u8s8(u, s));
#endif
}

inline __m256i dot_acc(__m256i acc, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  return dot_acc(dot_acc(acc, u0, s0), u1, s1);
#else
  return _mm256_add_epi32(acc, dot_u8s8x2(u0, s0, u1, s1));
#endif
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// output rows o .. o + 7 (packed chunk o / 8) for rows r .. r + RB - 1 of x.  8-bit weights q in
// 0..255 without VNNI: maddubs would saturate on q * x, so it takes |q - 128| beside x with
// (q - 128)'s sign (as q8_block8 does) and each 32's sum gets 128 * sum(x8) back: the same
// integers as VNNI's unsigned-by-signed sums, so the same bits.
template <int BITS, int RB, class S>
inline void packed_block(const RowsJob& job, int o, int r) {
  const int K = job.K, G = job.group, blocks = K / 32, per = G / 32, groups = K / G;
  const __m256i* pw = reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(job.w) + size_t(o) * K * BITS / 8);
  const size_t s_at = size_t(o) * groups;  // the chunk's scales and biases: [group][8]
  const int8_t* x8 = job.x8 + size_t(r) * K;
  const float* d32 = job.d8 + size_t(r) * blocks;
  const float* xsg = job.xsg + size_t(r) * groups;
  const __m256i m4 = _mm256_set1_epi8(15);
  __m256 acc[RB];
  for (int j = 0; j < RB; ++j) acc[j] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    __m256i sums[RB];
    for (int j = 0; j < RB; ++j) sums[j] = _mm256_setzero_si256();
    for (int u = 0; u < BITS; ++u) {
      const __m256i packed = _mm256_loadu_si256(pw + BITS * b + u);
      if constexpr (BITS == 4) {
        const __m256i lo = _mm256_and_si256(packed, m4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), m4);
        for (int j = 0; j < RB; ++j) {
          const int8_t* xj = x8 + size_t(j) * K + 32 * b + 8 * u;
          sums[j] = dot_acc(sums[j], lo, broadcast4(xj), hi, broadcast4(xj + 4));
        }
      } else if constexpr (kVnni) {
        for (int j = 0; j < RB; ++j) sums[j] = dot_acc(sums[j], packed, broadcast4(x8 + size_t(j) * K + 32 * b + 4 * u));
      } else {
        const __m256i q = _mm256_xor_si256(packed, _mm256_set1_epi8(char(0x80))), size = _mm256_abs_epi8(q);
        for (int j = 0; j < RB; ++j)
          sums[j] = _mm256_add_epi32(sums[j], dot_u8s8(size, _mm256_sign_epi8(broadcast4(x8 + size_t(j) * K + 32 * b + 4 * u), q)));
      }
    }
    if constexpr (BITS == 8 && !kVnni)
      for (int j = 0; j < RB; ++j) sums[j] = _mm256_add_epi32(sums[j], _mm256_set1_epi32(128 * job.xs8[size_t(r + j) * blocks + b]));
    const __m256 s = eight_at<S>(job.scales, s_at + size_t(b / per) * 8);
    for (int j = 0; j < RB; ++j)
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), _mm256_mul_ps(s, _mm256_set1_ps(d32[size_t(j) * blocks + b])), acc[j]);
    if ((b + 1) % per == 0) {
      const __m256 bias = eight_at<S>(job.biases, s_at + size_t(b / per) * 8);
      for (int j = 0; j < RB; ++j) acc[j] = _mm256_fmadd_ps(bias, _mm256_set1_ps(xsg[size_t(j) * groups + b / per]), acc[j]);
    }
  }
  for (int j = 0; j < RB; ++j) _mm256_storeu_ps(job.y + size_t(r + j) * job.N + o, acc[j]);
}

template <int BITS, class S>
void rows_packed_typed(const RowsJob& job, int o0, int o1) {
  for (int o = o0; o < o1; o += 8) {
    int r = 0;
    for (; r + WIDE_RB <= job.R; r += WIDE_RB) packed_block<BITS, WIDE_RB, S>(job, o, r);
    for (; r + 4 <= job.R; r += 4) packed_block<BITS, 4, S>(job, o, r);
    for (; r < job.R; ++r) packed_block<BITS, 1, S>(job, o, r);
  }
}

// output rows [o0, o1), both multiples of 8, of packed weights; x as quantize_packed wrote it
// (job.x8, its scales in job.d8, job.xsg, for 8-bit weights job.xs8)
void rows_q4p(const RowsJob& job, int o0, int o1) {
  by_scale_type(job.stype, [&](auto s) { rows_packed_typed<4, decltype(s)>(job, o0, o1); });
}

void rows_q8p(const RowsJob& job, int o0, int o1) {
  by_scale_type(job.stype, [&](auto s) { rows_packed_typed<8, decltype(s)>(job, o0, o1); });
}

// Q4_K super-blocks packed (rows_kernels.h, pack_k4): packed_block<4, RB, float> on the same
// nibbles, each 32's scale d * sc and bias -dmin * m computed from the super-block's fields as
// llama.cpp computes them (float32 products), so the same bits as the affine product of Q4_K
// re-laid with float32 scales and biases (gguf_tensors._repack_q4_k).  x as quantize_packed
// wrote it with groups of 32 (job.xsg: each 32's sum of x as rounded).
template <int RB>
inline void k4_block(const RowsJob& job, int o, int r) {
  const int K = job.K, blocks = K / 32, supers = K / 256;
  const __m256i* pw = reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(job.w) + size_t(o) * K / 2);
  const auto* fields = static_cast<const K4Fields*>(job.scales) + size_t(o / 8) * supers;
  const int8_t* x8 = job.x8 + size_t(r) * K;
  const float* d32 = job.d8 + size_t(r) * blocks;
  const float* xsg = job.xsg + size_t(r) * blocks;
  const __m256i m4 = _mm256_set1_epi8(15);
  __m256 acc[RB];
  for (int j = 0; j < RB; ++j) acc[j] = _mm256_setzero_ps();
  for (int sb = 0; sb < supers; ++sb) {
    const K4Fields& f = fields[sb];
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.d)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.dmin)));
    for (int b8 = 0; b8 < 8; ++b8) {
      const int b = 8 * sb + b8;
      __m256i sums[RB];
      for (int j = 0; j < RB; ++j) sums[j] = _mm256_setzero_si256();
      for (int u = 0; u < 4; ++u) {
        const __m256i packed = _mm256_loadu_si256(pw + 4 * b + u);
        const __m256i lo = _mm256_and_si256(packed, m4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), m4);
        for (int j = 0; j < RB; ++j) {
          const int8_t* xj = x8 + size_t(j) * K + 32 * b + 8 * u;
          sums[j] = dot_acc(sums[j], lo, broadcast4(xj), hi, broadcast4(xj + 4));
        }
      }
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f.sc[b8]))));
      const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f.m[b8]))));
      const __m256 s = _mm256_mul_ps(d, sc), bias = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, m));
      for (int j = 0; j < RB; ++j) {
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), _mm256_mul_ps(s, _mm256_set1_ps(d32[size_t(j) * blocks + b])), acc[j]);
        acc[j] = _mm256_fmadd_ps(bias, _mm256_set1_ps(xsg[size_t(j) * blocks + b]), acc[j]);
      }
    }
  }
  for (int j = 0; j < RB; ++j) _mm256_storeu_ps(job.y + size_t(r + j) * job.N + o, acc[j]);
}

// Q6_K super-blocks packed (rows_kernels.h, K6Fields): each 32's low nibbles as the 4-bit
// packed weights hold them (job.w), their high two bits two words a 32 (job.biases: for the
// dwords 2p and 2p + 1, byte j holds the high bits of the dword 2p's values 2j and 2j + 1 in
// bits 0-3 and the dword 2p + 1's in bits 4-7), and per super-block d and the 16s' int8
// scales (job.scales).  q = low | high << 4 in 0..63 meets x's bytes in each 16's integer
// sum, less 32 times x's sum there (job.xs8: each 16's sum of x8), times d * sc and x's scale.
template <int RB>
inline void k6_block(const RowsJob& job, int o, int r) {
  const int K = job.K, blocks = K / 32, supers = K / 256;
  const __m256i* pw = reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(job.w) + size_t(o) * K / 2);
  const __m256i* ph = reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(job.biases) + size_t(o) * K / 4);
  const auto* fields = static_cast<const K6Fields*>(job.scales) + size_t(o / 8) * supers;
  const int8_t* x8 = job.x8 + size_t(r) * K;
  const float* d32 = job.d8 + size_t(r) * blocks;
  const int32_t* xs16 = job.xs8 + size_t(r) * (K / 16);
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
  __m256 acc[RB];
  for (int j = 0; j < RB; ++j) acc[j] = _mm256_setzero_ps();
  for (int sb = 0; sb < supers; ++sb) {
    const K6Fields& f = fields[sb];
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.d)));
    for (int b8 = 0; b8 < 8; ++b8) {
      const int b = 8 * sb + b8;
      __m256i sums[2][RB];
      for (int p = 0; p < 2; ++p) {
        for (int j = 0; j < RB; ++j) sums[p][j] = _mm256_setzero_si256();
        const __m256i h = _mm256_loadu_si256(ph + 2 * b + p);
        for (int uu = 0; uu < 2; ++uu) {
          const int u = 2 * p + uu;
          const __m256i packed = _mm256_loadu_si256(pw + 4 * b + u);
          const __m256i he = uu == 0 ? _mm256_and_si256(_mm256_slli_epi16(h, 4), m30) : _mm256_and_si256(h, m30);
          const __m256i ho = uu == 0 ? _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)
                                     : _mm256_and_si256(_mm256_srli_epi16(h, 2), m30);
          const __m256i qe = _mm256_or_si256(_mm256_and_si256(packed, m4), he);
          const __m256i qo = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), m4), ho);
          for (int j = 0; j < RB; ++j) {
            const int8_t* xj = x8 + size_t(j) * K + 32 * b + 8 * u;
            sums[p][j] = dot_acc(sums[p][j], qe, broadcast4(xj), qo, broadcast4(xj + 4));
          }
        }
      }
      for (int p = 0; p < 2; ++p) {
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f.sc[2 * b8 + p]))));
        const __m256 s = _mm256_mul_ps(d, sc);
        for (int j = 0; j < RB; ++j) {
          const __m256i centred = _mm256_sub_epi32(sums[p][j], _mm256_set1_epi32(32 * xs16[size_t(j) * (K / 16) + 2 * b + p]));
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(s, _mm256_set1_ps(d32[size_t(j) * blocks + b])), acc[j]);
        }
      }
    }
  }
  for (int j = 0; j < RB; ++j) _mm256_storeu_ps(job.y + size_t(r + j) * job.N + o, acc[j]);
}

// Q5_0 and Q5_1 blocks packed (rows_kernels.h, K5Fields): the low nibbles as the 4-bit packed
// weights hold them (job.w), each 32's fifth bits one word a row, eight rows side by side
// (job.biases: bit i the value i's), and per 32 the rows' d and m (job.scales).  q = low |
// fifth << 4 in 0..31: each 32's integer sum times d and x's scale, plus m times x's sum there.
template <int RB>
inline void k5_block(const RowsJob& job, int o, int r) {
  const int K = job.K, blocks = K / 32;
  const __m256i* pw = reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(job.w) + size_t(o) * K / 2);
  const __m256i* ph = reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(job.biases) + size_t(o) * K / 8);
  const auto* fields = static_cast<const K5Fields*>(job.scales) + size_t(o / 8) * blocks;
  const int8_t* x8 = job.x8 + size_t(r) * K;
  const float* d32 = job.d8 + size_t(r) * blocks;
  const float* xsg = job.xsg + size_t(r) * blocks;
  const __m256i m4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(0x10);
  // the bits of values 2j (even) and 2j + 1 (odd) of a byte, tested in byte j
  const __m256i even = _mm256_set1_epi32(0x40100401), odd = _mm256_set1_epi32(int(0x80200802u));
  const __m256i lanes = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404, 0x08080808, 0x0c0c0c0c);
  __m256 acc[RB];
  for (int j = 0; j < RB; ++j) acc[j] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const K5Fields& f = fields[b];
    const __m256i h = _mm256_loadu_si256(ph + b);
    __m256i sums[RB];
    for (int j = 0; j < RB; ++j) sums[j] = _mm256_setzero_si256();
    for (int u = 0; u < 4; ++u) {
      const __m256i packed = _mm256_loadu_si256(pw + 4 * b + u);
      // each row's byte u (its values 8u .. 8u + 7's fifth bits) in all four bytes of its lane
      const __m256i spread = _mm256_shuffle_epi8(h, _mm256_add_epi8(lanes, _mm256_set1_epi8(char(u))));
      const __m256i he = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, even), even), bit4);
      const __m256i ho = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, odd), odd), bit4);
      const __m256i qe = _mm256_or_si256(_mm256_and_si256(packed, m4), he);
      const __m256i qo = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), m4), ho);
      for (int j = 0; j < RB; ++j) {
        const int8_t* xj = x8 + size_t(j) * K + 32 * b + 8 * u;
        sums[j] = dot_acc(sums[j], qe, broadcast4(xj), qo, broadcast4(xj + 4));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.d)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.m)));
    for (int j = 0; j < RB; ++j) {
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), _mm256_mul_ps(d, _mm256_set1_ps(d32[size_t(j) * blocks + b])), acc[j]);
      acc[j] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsg[size_t(j) * blocks + b]), acc[j]);
    }
  }
  for (int j = 0; j < RB; ++j) _mm256_storeu_ps(job.y + size_t(r + j) * job.N + o, acc[j]);
}

// Q5_K super-blocks packed (rows_kernels.h: pack_k5k): Q4_K's nibbles and K4Fields with Q5's
// fifth bits (job.biases, one word a row and 32, eight rows side by side), q = low | fifth << 4
// in 0..31; each 32's scale d * sc and bias -dmin * m as k4_block computes them.
template <int RB>
inline void k5k_block(const RowsJob& job, int o, int r) {
  const int K = job.K, blocks = K / 32, supers = K / 256;
  const __m256i* pw = reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(job.w) + size_t(o) * K / 2);
  const __m256i* ph = reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(job.biases) + size_t(o) * K / 8);
  const auto* fields = static_cast<const K4Fields*>(job.scales) + size_t(o / 8) * supers;
  const int8_t* x8 = job.x8 + size_t(r) * K;
  const float* d32 = job.d8 + size_t(r) * blocks;
  const float* xsg = job.xsg + size_t(r) * blocks;
  const __m256i m4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(0x10);
  const __m256i even = _mm256_set1_epi32(0x40100401), odd = _mm256_set1_epi32(int(0x80200802u));
  const __m256i lanes = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404, 0x08080808, 0x0c0c0c0c);
  __m256 acc[RB];
  for (int j = 0; j < RB; ++j) acc[j] = _mm256_setzero_ps();
  for (int sb = 0; sb < supers; ++sb) {
    const K4Fields& f = fields[sb];
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.d)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f.dmin)));
    for (int b8 = 0; b8 < 8; ++b8) {
      const int b = 8 * sb + b8;
      const __m256i h = _mm256_loadu_si256(ph + b);
      __m256i sums[RB];
      for (int j = 0; j < RB; ++j) sums[j] = _mm256_setzero_si256();
      for (int u = 0; u < 4; ++u) {
        const __m256i packed = _mm256_loadu_si256(pw + 4 * b + u);
        const __m256i spread = _mm256_shuffle_epi8(h, _mm256_add_epi8(lanes, _mm256_set1_epi8(char(u))));
        const __m256i he = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, even), even), bit4);
        const __m256i ho = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, odd), odd), bit4);
        const __m256i qe = _mm256_or_si256(_mm256_and_si256(packed, m4), he);
        const __m256i qo = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), m4), ho);
        for (int j = 0; j < RB; ++j) {
          const int8_t* xj = x8 + size_t(j) * K + 32 * b + 8 * u;
          sums[j] = dot_acc(sums[j], qe, broadcast4(xj), qo, broadcast4(xj + 4));
        }
      }
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f.sc[b8]))));
      const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(f.m[b8]))));
      const __m256 s = _mm256_mul_ps(d, sc), bias = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, m));
      for (int j = 0; j < RB; ++j) {
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), _mm256_mul_ps(s, _mm256_set1_ps(d32[size_t(j) * blocks + b])), acc[j]);
        acc[j] = _mm256_fmadd_ps(bias, _mm256_set1_ps(xsg[size_t(j) * blocks + b]), acc[j]);
      }
    }
  }
  for (int j = 0; j < RB; ++j) _mm256_storeu_ps(job.y + size_t(r + j) * job.N + o, acc[j]);
}

void rows_k5p(const RowsJob& job, int o0, int o1) {
  for (int o = o0; o < o1; o += 8) {
    int r = 0;
    if (job.super_block == 256) {
      for (; r + WIDE_RB <= job.R; r += WIDE_RB) k5k_block<WIDE_RB>(job, o, r);
      for (; r + 4 <= job.R; r += 4) k5k_block<4>(job, o, r);
      for (; r < job.R; ++r) k5k_block<1>(job, o, r);
      continue;
    }
    for (; r + WIDE_RB <= job.R; r += WIDE_RB) k5_block<WIDE_RB>(job, o, r);
    for (; r + 4 <= job.R; r += 4) k5_block<4>(job, o, r);
    for (; r < job.R; ++r) k5_block<1>(job, o, r);
  }
}

void rows_k6p(const RowsJob& job, int o0, int o1) {
  for (int o = o0; o < o1; o += 8) {
    int r = 0;
    for (; r + 4 <= job.R; r += 4) k6_block<4>(job, o, r);
    for (; r < job.R; ++r) k6_block<1>(job, o, r);
  }
}

void rows_k4p(const RowsJob& job, int o0, int o1) {
  for (int o = o0; o < o1; o += 8) {
    int r = 0;
    for (; r + WIDE_RB <= job.R; r += WIDE_RB) k4_block<WIDE_RB>(job, o, r);
    for (; r + 4 <= job.R; r += 4) k4_block<4>(job, o, r);
    for (; r < job.R; ++r) k4_block<1>(job, o, r);
  }
}
#endif

} // namespace turbospark::kernels::ROWS_NS

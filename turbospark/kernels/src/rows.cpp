#include "rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <csetjmp>
#include <csignal>
#include <dlfcn.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/ops.h"
#include "mlx/types/half_types.h"
#include "enqueue.h"
#include "ggml_blocks.h"
#include "kquants.h"
#include "norm.h"
#include "pool.h"
#include "round.h"
#include "strided.h"
#include "rows_kernels.h"

namespace turbospark::kernels {

namespace {

std::vector<const Isa*> runnable() {
  std::vector<const Isa*> out;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
#if defined(KERNELS_WITH_VNNI)
    if (__builtin_cpu_supports("avxvnni") && vnni_runs()) out.push_back(&isa_vnni());
#endif
#if defined(KERNELS_WITH_AVX512VNNI)
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && avx512vnni_runs())
      out.push_back(&isa_avx512vnni());
#endif
    out.push_back(&isa_avx2());
  }
#endif
  out.push_back(&isa_portable());
  return out;
}

std::atomic<const Isa*>& current() {
  static std::atomic<const Isa*> isa{runnable().front()};
  return isa;
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  int n = std::atoi(v);
  return n > 0 ? n : fallback;
}

int cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// Below this many bytes of weights a product runs on one thread (waking the others costs more).
constexpr size_t kParallelBytes = 64 << 10;

// From this many rows of x (a prompt chunk) a product of float weights, or of quantized ones
// with x kept float32, is a GEMM: its weights are widened to float32 a block of rows at a time,
// in L2, and multiplied by the BLAS MLX itself uses (OpenBLAS where serve preloads it), which is
// faster than the float kernels at many rows.
constexpr int kGemmRows = 24;
// From this many rows of x, a product is a prompt's work, split over the whole team.
constexpr int kPromptRows = 16;
constexpr int kGemmBlock = 256;

using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);

// cblas_sgemm as MLX's own calls resolve it: the process's (a preloaded OpenBLAS), else the one
// libmlx depends on; null when neither is found (then the kernels run every product).
Sgemm sgemm() {
  static Sgemm f = [] {
    void* sym = dlsym(RTLD_DEFAULT, "cblas_sgemm");
    Dl_info info;
    if (sym == nullptr && dladdr(reinterpret_cast<void*>(&mx::allocator::allocator), &info) != 0) {
      if (void* lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD)) sym = dlsym(lib, "cblas_sgemm");
    }
    return reinterpret_cast<Sgemm>(sym);
  }();
  return f;
}

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

template <class T>
void widen(const mx::array& x, int R, int K, float* dst) {
  const int64_t s1 = x.strides().back();
  for (int r = 0; r < R; ++r) {
    const T* row = x.data<T>() + row_offset(x, r);
    if constexpr (std::is_same_v<T, float>) {
      if (s1 == 1) {
        std::memcpy(dst + size_t(r) * K, row, sizeof(float) * K);
        continue;
      }
    }
    for (int k = 0; k < K; ++k) dst[size_t(r) * K + k] = static_cast<float>(row[k * s1]);
  }
}

float scalar_at(const mx::array& a, size_t i) {
  switch (a.dtype()) {
    case mx::float32:
      return a.data<float>()[i];
    case mx::bfloat16:
      return static_cast<float>(a.data<mx::bfloat16_t>()[i]);
    default:
      return static_cast<float>(a.data<mx::float16_t>()[i]);
  }
}

ScaleType scale_type(mx::Dtype t) {
  return t == mx::float32 ? ScaleType::F32 : t == mx::bfloat16 ? ScaleType::BF16 : ScaleType::F16;
}

void check_float(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32 && a.dtype() != mx::bfloat16 && a.dtype() != mx::float16)
    throw std::invalid_argument(std::string("[rows_matmul] ") + what + " must be float32, bfloat16 or float16");
}

// Weights are read in place: row-contiguous already, or made so.
mx::array row_major(const mx::array& a, const mx::Stream& s) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

// The norm prologue (rows.h): each row of xf (R x K, x's values widened from T) in place.
template <class T>
void rms_norm_rows(float* xf, int R, int K, const mx::array& weight, float eps) {
  for (int r = 0; r < R; ++r) {
    float* row = xf + size_t(r) * K;
    rms_norm_row<T>(K, eps, weight.data<T>(), 1, [row](int d) { return row[d]; },
                    [row](int d, T v) { row[d] = static_cast<float>(v); });
  }
}

mx::array rows_op(const mx::array& x, std::vector<mx::array> weights, const std::optional<mx::array>& bias,
                  int N, int K, int group_size, int bits, const std::optional<mx::array>& residual, int glu,
                  const Prologue& prologue, bool packed, mx::StreamOrDevice s, int ggml_type = -1) {
  auto stream = mx::to_stream(s);
  check_float(x, "x");
  if (x.ndim() < 1 || x.shape(-1) != K)
    throw std::invalid_argument("[rows_matmul] x's last dimension must match the weight's");
  if (K % 8 != 0) throw std::invalid_argument("[rows_matmul] the inner dimension must be a multiple of 8");
  const bool gated = glu == SwiGlu || glu == GeGlu;
  if (residual && glu) throw std::invalid_argument("[rows_matmul] a residual or an activation, not both");
  if (gated && N % 2 != 0) throw std::invalid_argument("[rows_matmul] a gated activation needs the gate's and the up rows (2 * H)");
  std::vector<mx::array> inputs{x};
  for (auto& w : weights) inputs.push_back(row_major(w, stream));
  if (bias) {
    check_float(*bias, "bias");
    if (bias->ndim() != 1 || bias->shape(0) != N) throw std::invalid_argument("[rows_matmul] bias must be (N,)");
    inputs.push_back(row_major(*bias, stream));
  }
  auto shape = x.shape();
  shape.back() = gated ? N / 2 : N;
  if (residual) {
    if (residual->shape() != shape) throw std::invalid_argument("[rows_matmul] the residual must have the output's shape");
    inputs.push_back(mx::astype(*residual, x.dtype(), stream));
  }
  if (prologue.norm) {
    const auto& w = *prologue.norm;
    if (w.ndim() != 1 || w.shape(0) != K) throw std::invalid_argument("[rows_matmul] the norm's weight must be (K,)");
    inputs.push_back(row_major(mx::astype(w, x.dtype(), stream), stream));
  }
  auto epilogue = residual ? Epilogue::Residual : glu == SwiGlu ? Epilogue::Swiglu : glu == GeGlu ? Epilogue::Geglu
                  : glu == Gelu ? Epilogue::Gelu : Epilogue::None;
  return mx::array(std::move(shape), x.dtype(),
                   std::make_shared<RowsMatmul>(stream, group_size, bits, bool(bias), epilogue, bool(prologue.norm),
                                                prologue.eps, packed, ggml_type),
                   std::move(inputs));
}

// Writes y (R x N, float32) into out, in out's type, through the epilogue (rows.h).
template <class T>
void finish(const float* y, int R, int N, Epilogue epilogue, const mx::array* residual, mx::array& out) {
  T* o = out.data<T>();
  if (epilogue == Epilogue::Residual) {
    const T* rp = residual->data<T>();
    const int64_t s1 = residual->strides().back();
    for (int r = 0; r < R; ++r) {
      const T* res = rp + row_offset(*residual, r);
      T* orow = o + size_t(r) * N;
      const float* yr = y + size_t(r) * N;
      if constexpr (std::is_same_v<T, float>) {
        if (s1 == 1) {  // the usual case, in a loop the compiler vectorizes
          for (int n = 0; n < N; ++n) orow[n] = res[n] + yr[n];
          continue;
        }
      }
      for (int n = 0; n < N; ++n) orow[n] = static_cast<T>(static_cast<float>(res[n * s1]) + round_to<T>(yr[n]));
    }
  } else if (epilogue == Epilogue::Swiglu) {
    // mx.sigmoid of the gate as MLX's CPU backend computes it (unary_ops.h): exp of |g| rounded
    // to T, the rest in float32, the result rounded to T; then g * sigmoid(g) * up, each rounded
    const int H = N / 2;
    std::vector<float> e(H);
    const Isa& isa = active_isa();
    for (int r = 0; r < R; ++r) {
      const float* yr = y + size_t(r) * N;
      if constexpr (std::is_same_v<T, float>) {  // float32: nothing to round, eight at a time
        isa.swiglu(yr, yr + H, o + size_t(r) * H, e.data(), H);
        continue;
      }
      for (int i = 0; i < H; ++i) e[i] = std::fabs(round_to<T>(yr[i]));
      isa.exps(e.data(), H);
      for (int i = 0; i < H; ++i) {
        const float g = round_to<T>(yr[i]), u = round_to<T>(yr[H + i]);
        const float s = 1.0f / (1.0f + round_to<T>(e[i]));
        const float sig = round_to<T>(g < 0 ? s : 1.0f - s);
        o[size_t(r) * H + i] = static_cast<T>(round_to<T>(g * sig) * u);
      }
    }
  } else if (epilogue == Epilogue::Geglu) {
    // gelu_approx(g) = 0.5 g (1 + tanh(z)) = g / (1 + exp(-2 z)), z = c (g + 0.044715 g^3), with
    // MLX's exp; from g and up rounded to T, the gelu rounded to T, times up, rounded
    const int H = N / 2;
    const float c = -2.0f * 0.7978845608028654f, k = 0.044715f;
    std::vector<float> e(H);
    const Isa& isa = active_isa();
    for (int r = 0; r < R; ++r) {
      const float* yr = y + size_t(r) * N;
      for (int i = 0; i < H; ++i) {
        const float g = round_to<T>(yr[i]);
        e[i] = c * (g + k * (g * g * g));
      }
      isa.exps(e.data(), H);
      T* orow = o + size_t(r) * H;
      for (int i = 0; i < H; ++i) {
        const float g = round_to<T>(yr[i]), u = round_to<T>(yr[H + i]);
        orow[i] = static_cast<T>(round_to<T>(g / (1.0f + e[i])) * u);
      }
    }
  } else if (epilogue == Epilogue::Gelu) {
    // erf by Abramowitz and Stegun 7.1.26 (|error| < 1.5e-7) over the kernels' exp: with
    // z = |g| / sqrt 2, t = 1 / (1 + p z) and q = poly(t) exp(-z^2), 1 + erf(g / sqrt 2) is q for
    // g < 0 (no cancellation in the tail) and 2 - q for g >= 0
    const Isa& isa = active_isa();
    if constexpr (std::is_same_v<T, float>) {  // float32: nothing to round; the set's vectors, rows split
      auto& team = pool();
      const int parts = size_t(R) * N < (1 << 16) ? 1 : team.size(), chunks = std::min(R, 4 * parts);
      team.run([&](int c) {
        std::vector<float> scratch(N);
        for (int r = R * c / chunks; r < R * (c + 1) / chunks; ++r)
          isa.gelus(y + size_t(r) * N, o + size_t(r) * N, scratch.data(), N);
      }, chunks, parts);
      return;
    }
    std::vector<float> e(N), t(N);
    for (int r = 0; r < R; ++r) {
      const float* yr = y + size_t(r) * N;
      for (int i = 0; i < N; ++i) {
        const float z = std::fabs(round_to<T>(yr[i])) * 0.70710678118654752f;
        e[i] = -z * z;
        t[i] = 1.0f / (1.0f + 0.3275911f * z);
      }
      isa.exps(e.data(), N);
      T* orow = o + size_t(r) * N;
      for (int i = 0; i < N; ++i) {
        const float g = round_to<T>(yr[i]), u = t[i];
        const float q =
            u * (0.254829592f + u * (-0.284496736f + u * (1.421413741f + u * (-1.453152027f + u * 1.061405429f)))) * e[i];
        orow[i] = static_cast<T>(0.5f * g * (g >= 0 ? 2.0f - q : q));
      }
    }
  } else {
    for (size_t i = 0; i < size_t(R) * N; ++i) o[i] = static_cast<T>(y[i]);
  }
}

} // namespace

namespace {
sigjmp_buf sigill_jump;
void on_sigill(int) { siglongjmp(sigill_jump, 1); }
} // namespace

bool runs_without_sigill(void (*fn)()) {
  struct sigaction ours{}, before{};
  ours.sa_handler = on_sigill;
  sigemptyset(&ours.sa_mask);
  if (sigaction(SIGILL, &ours, &before) != 0) return false;
  volatile bool ran = false;
  if (sigsetjmp(sigill_jump, 1) == 0) {
    fn();
    ran = true;
  }
  sigaction(SIGILL, &before, nullptr);
  return ran;
}

const Isa& active_isa() { return *current().load(); }

Pool& pool() {
  static Pool* p = new Pool(env_int("TURBOSPARK_KERNEL_THREADS", cores()), env_int("TURBOSPARK_KERNEL_SPIN_US", 200));
  return *p;
}

std::vector<std::string> isas() {
  std::vector<std::string> names;
  for (auto* isa : runnable()) names.emplace_back(isa->name);
  return names;
}

std::string isa() { return current().load()->name; }

std::atomic<bool>& activations_in_8_bits() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("TURBOSPARK_KERNELS_EXACT");
    return v == nullptr || *v == '\0' || std::string(v) == "0";
  }()};
  return on;
}

bool x_in_8_bits(const Isa& isa) {
  return isa.rows_q8 != nullptr && activations_in_8_bits().load(std::memory_order_relaxed);
}

bool x_in_8_bits() { return x_in_8_bits(*current().load()); }

bool use_isa(const std::string& name) {
  for (auto* isa : runnable())
    if (name == isa->name) {
      current().store(isa);
      return true;
    }
  return false;
}

int threads() { return pool().size(); }

std::atomic<int>& step_setting() {
  static std::atomic<int> n{env_int("TURBOSPARK_KERNEL_STEP_THREADS", 0)};
  return n;
}

int step_parts() {
  const int n = step_setting().load(std::memory_order_relaxed);
  return n > 0 ? std::min(n, pool().size()) : pool().size();
}

size_t huge_pages(const std::vector<mx::array>& arrays) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (auto& a : arrays) {
    if (!a.is_available() || a.nbytes() == 0) continue;
    auto begin = reinterpret_cast<uintptr_t>(a.data<char>());
    spans.emplace_back(begin & ~(page - 1), (begin + a.nbytes() + page - 1) & ~(page - 1));
  }
  std::sort(spans.begin(), spans.end());
  std::vector<std::pair<uintptr_t, uintptr_t>> merged;
  for (auto& s : spans) {
    if (!merged.empty() && s.first <= merged.back().second + 2 * page)
      merged.back().second = std::max(merged.back().second, s.second);
    else
      merged.push_back(s);
  }
  size_t done = 0;
  for (auto& [b, e] : merged) {
    uintptr_t hb = (b + kHuge - 1) & ~(kHuge - 1), he = e & ~(kHuge - 1);
    if (hb >= he) continue;
    if (madvise(reinterpret_cast<void*>(hb), he - hb, MADV_HUGEPAGE) != 0) continue;
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
    // A piece that cannot be collapsed (a hole between two buffers) fails alone.
    for (uintptr_t p = hb; p < he; p += kHuge)
      if (madvise(reinterpret_cast<void*>(p), kHuge, MADV_COLLAPSE) == 0) done += kHuge;
  }
  return done;
#else
  return 0;
#endif
}

mx::array rows_matmul(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias,
                      const std::optional<mx::array>& residual, int glu, const Prologue& prologue,
                      mx::StreamOrDevice s) {
  check_float(w, "w");
  if (w.ndim() != 2) throw std::invalid_argument("[rows_matmul] w must be (N, K)");
  return rows_op(x, {w}, bias, w.shape(0), w.shape(1), 0, 0, residual, glu, prologue, false, s);
}

mx::array rows_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                const mx::array& biases, const std::optional<mx::array>& bias,
                                int group_size, int bits, const std::optional<mx::array>& residual, int glu,
                                const Prologue& prologue, bool packed, mx::StreamOrDevice s) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("[rows_quantized_matmul] bits must be 4 or 8");
  if (packed && (w.ndim() != 2 || w.shape(0) % 8 != 0))
    throw std::invalid_argument("[rows_quantized_matmul] packed weights come eight rows a chunk");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("[rows_quantized_matmul] group_size must be 32, 64 or 128");
  if (w.dtype() != mx::uint32 || w.ndim() != 2)
    throw std::invalid_argument("[rows_quantized_matmul] w must be (N, K * bits / 32) uint32");
  check_float(scales, "scales");
  if (biases.dtype() != scales.dtype()) throw std::invalid_argument("[rows_quantized_matmul] scales and biases differ in type");
  int N = w.shape(0), K = w.shape(1) * 32 / bits;
  if (scales.shape() != mx::Shape{N, K / group_size} || biases.shape() != scales.shape())
    throw std::invalid_argument("[rows_quantized_matmul] scales and biases must be (N, K / group_size)");
  return rows_op(x, {w, scales, biases}, bias, N, K, group_size, bits, residual, glu, prologue, packed, s);
}

mx::array rows_ggml_matmul(const mx::array& x, const mx::array& w, int type, int K,
                           const std::optional<mx::array>& bias, const std::optional<mx::array>& residual,
                           int glu, const Prologue& prologue, mx::StreamOrDevice s) {
  if (ggml_row_bytes(type, K) == 0) throw std::invalid_argument("[rows_ggml_matmul] a type ggml has no product for here");
  if (w.dtype() != mx::uint8 || w.ndim() != 2 || size_t(w.shape(1)) != ggml_row_bytes(type, K))
    throw std::invalid_argument("[rows_ggml_matmul] w must be (N, row bytes) uint8 of its type");
  return rows_op(x, {w}, bias, w.shape(0), K, 0, 0, residual, glu, prologue, false, s, type);
}

mx::array rows_k4_matmul(const mx::array& x, const mx::array& w, const mx::array& fields,
                         const std::optional<mx::array>& bias, const std::optional<mx::array>& residual,
                         int glu, const Prologue& prologue, mx::StreamOrDevice s) {
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || w.shape(0) % 8 != 0 || (w.shape(1) * 8) % 256 != 0)
    throw std::invalid_argument("[rows_k4_matmul] w must be (N, K / 8) uint32, N a multiple of 8 and K of 256");
  const int N = w.shape(0), K = w.shape(1) * 8;
  if (fields.dtype() != mx::uint8 || fields.size() != size_t(N / 8) * (K / 256) * sizeof(K4Fields))
    throw std::invalid_argument("[rows_k4_matmul] fields must be the chunks' K4Fields as uint8");
  return rows_op(x, {w, mx::flatten(fields)}, bias, N, K, 256, 4, residual, glu, prologue, true, s);
}

mx::array rows_k6_matmul(const mx::array& x, const mx::array& w, const mx::array& highs, const mx::array& fields,
                         const std::optional<mx::array>& bias, const std::optional<mx::array>& residual,
                         int glu, const Prologue& prologue, mx::StreamOrDevice s) {
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || w.shape(0) % 8 != 0 || (w.shape(1) * 8) % 256 != 0)
    throw std::invalid_argument("[rows_k6_matmul] w must be (N, K / 8) uint32, N a multiple of 8 and K of 256");
  const int N = w.shape(0), K = w.shape(1) * 8;
  if (highs.dtype() != mx::uint32 || highs.shape() != mx::Shape{N, K / 16})
    throw std::invalid_argument("[rows_k6_matmul] highs must be (N, K / 16) uint32");
  if (fields.dtype() != mx::uint8 || fields.size() != size_t(N / 8) * (K / 256) * sizeof(K6Fields))
    throw std::invalid_argument("[rows_k6_matmul] fields must be the chunks' K6Fields as uint8");
  return rows_op(x, {w, mx::flatten(fields), highs}, bias, N, K, 256, 6, residual, glu, prologue, true, s);
}

mx::array rows_k5_matmul(const mx::array& x, const mx::array& w, const mx::array& highs, const mx::array& fields,
                         const std::optional<mx::array>& bias, const std::optional<mx::array>& residual,
                         int glu, const Prologue& prologue, mx::StreamOrDevice s) {
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || w.shape(0) % 8 != 0 || (w.shape(1) * 8) % 64 != 0)
    throw std::invalid_argument("[rows_k5_matmul] w must be (N, K / 8) uint32, N a multiple of 8 and K of 64");
  const int N = w.shape(0), K = w.shape(1) * 8;
  if (highs.dtype() != mx::uint32 || highs.shape() != mx::Shape{N, K / 32})
    throw std::invalid_argument("[rows_k5_matmul] highs must be (N, K / 32) uint32");
  if (fields.dtype() != mx::uint8 || fields.size() != size_t(N / 8) * (K / 32) * sizeof(K5Fields))
    throw std::invalid_argument("[rows_k5_matmul] fields must be the chunks' K5Fields as uint8");
  return rows_op(x, {w, mx::flatten(fields), highs}, bias, N, K, 32, 5, residual, glu, prologue, true, s);
}

mx::array rows_k5k_matmul(const mx::array& x, const mx::array& w, const mx::array& highs, const mx::array& fields,
                          const std::optional<mx::array>& bias, const std::optional<mx::array>& residual,
                          int glu, const Prologue& prologue, mx::StreamOrDevice s) {
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || w.shape(0) % 8 != 0 || (w.shape(1) * 8) % 256 != 0)
    throw std::invalid_argument("[rows_k5k_matmul] w must be (N, K / 8) uint32, N a multiple of 8 and K of 256");
  const int N = w.shape(0), K = w.shape(1) * 8;
  if (highs.dtype() != mx::uint32 || highs.shape() != mx::Shape{N, K / 32})
    throw std::invalid_argument("[rows_k5k_matmul] highs must be (N, K / 32) uint32");
  if (fields.dtype() != mx::uint8 || fields.size() != size_t(N / 8) * (K / 256) * sizeof(K4Fields))
    throw std::invalid_argument("[rows_k5k_matmul] fields must be the chunks' K4Fields as uint8");
  return rows_op(x, {w, mx::flatten(fields), highs}, bias, N, K, 256, 5, residual, glu, prologue, true, s);
}

bool reads_k(int bits) {
  const Isa* isa = current().load();
  const RowsFn fn = bits == 4 ? isa->rows_k4p : bits == 5 ? isa->rows_k5p : isa->rows_k6p;
  return fn != nullptr && x_in_8_bits(*isa);
}

namespace {
// an array of a's shape and type in a buffer of its own (not MLX's allocator's: freed with the
// array), its bytes not yet written
mx::array like(const mx::array& a) {
  void* p = std::malloc(std::max<size_t>(a.nbytes(), 1));
  if (p == nullptr) throw std::bad_alloc();
  return mx::array(p, a.shape(), a.dtype(), [](void* q) { std::free(q); });
}
} // namespace

std::vector<mx::array> pack_quantized(const mx::array& w, const mx::array& scales, const mx::array& biases,
                                      int group_size, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("[pack_quantized] bits must be 4 or 8");
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || w.shape(0) % 8 != 0 || w.shape(1) % bits != 0)
    throw std::invalid_argument("[pack_quantized] w must be (N, K * bits / 32) uint32 with N a multiple of 8 and K of 32");
  if (group_size != 32 && group_size != 64 && group_size != 128) throw std::invalid_argument("[pack_quantized] group_size must be 32, 64 or 128");
  check_float(scales, "scales");
  const int N = w.shape(0), K = w.shape(1) * 32 / bits;
  if (scales.shape() != mx::Shape{N, K / group_size} || biases.shape() != scales.shape() || biases.dtype() != scales.dtype())
    throw std::invalid_argument("[pack_quantized] scales and biases must be (N, K / group_size), of one type");
  std::vector<mx::array> in, out;
  for (const auto* a : {&w, &scales, &biases}) {
    in.push_back(mx::contiguous(*a));
    in.back().eval();
    out.push_back(like(*a));
  }
  pack_q(in[0].data<uint8_t>(), in[1].data<uint8_t>(), in[2].data<uint8_t>(), int(scales.itemsize()), N, K, group_size,
         bits, true, out[0].data<uint8_t>(), out[1].data<uint8_t>(), out[2].data<uint8_t>());
  return out;
}

bool reads_packed(int bits) {
  const Isa* isa = current().load();
  return (bits == 4 ? isa->rows_q4p : isa->rows_q8p) != nullptr && x_in_8_bits(*isa);
}

void RowsMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[RowsMatmul] runs on the CPU only");
}

bool RowsMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const RowsMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && has_bias_ == o.has_bias_ && epilogue_ == o.epilogue_ &&
         has_norm_ == o.has_norm_ && eps_ == o.eps_ && packed_ == o.packed_ && ggml_type_ == o.ggml_type_;
}

std::vector<mx::Shape> RowsMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = epilogue_ == Epilogue::Swiglu || epilogue_ == Epilogue::Geglu ? inputs[1].shape(0) / 2 : inputs[1].shape(0);
  return {shape};
}

namespace {
// n values left uninitialized (each is written before it is read): a prompt chunk's megabytes of
// x and y are not cleared first
template <class T>
class Scratch {
 public:
  Scratch() = default;
  explicit Scratch(size_t n) { resize(n); }
  void resize(size_t n) { p_.reset(new T[n]); }
  T* data() { return p_.get(); }

 private:
  std::unique_ptr<T[]> p_;
};
} // namespace

void RowsMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto work = [bits = bits_, group = group_size_, has_bias = has_bias_, epilogue = epilogue_, has_norm = has_norm_,
               eps = eps_, packed = packed_, ggml_type = ggml_type_](std::vector<mx::array>& in, mx::array& out) {
    const auto& x = in[0];
    const int K = x.shape(-1), N = in[1].shape(0);
    const int R = K == 0 ? 0 : int(x.size() / K);
    if (R == 0 || N == 0) return;
    Scratch<float> xf(size_t(R) * K);
    switch (x.dtype()) {
      case mx::float32:
        widen<float>(x, R, K, xf.data());
        if (has_norm) rms_norm_rows<float>(xf.data(), R, K, in.back(), eps);
        break;
      case mx::bfloat16:
        widen<mx::bfloat16_t>(x, R, K, xf.data());
        if (has_norm) rms_norm_rows<mx::bfloat16_t>(xf.data(), R, K, in.back(), eps);
        break;
      default:
        widen<mx::float16_t>(x, R, K, xf.data());
        if (has_norm) rms_norm_rows<mx::float16_t>(xf.data(), R, K, in.back(), eps);
    }
    Scratch<float> yf;
    float* y = out.data<float>();
    const bool direct = out.dtype() == mx::float32 && epilogue == Epilogue::None;
    if (!direct) {
      yf.resize(size_t(R) * N);
      y = yf.data();
    }
    // packed Q4_K super-blocks (rows_k4_matmul), Q5_0/Q5_1 (bits 5, group 32) and Q5_K (group 256),
    // Q6_K: their 32s' scales and biases meet x's 32s
    const bool k4 = packed && bits == 4 && group == 256, k5 = packed && bits == 5, k6 = packed && bits == 6;
    const int x_group = k4 || k5 || k6 ? 32 : group;
    RowsJob job{xf.data(), R, K, N, WeightType::F32, in[1].data<void>(), nullptr, nullptr, ScaleType::F32, x_group, y};
    job.super_block = k5 && group == 256 ? 256 : 0;  // Q5_K (rows_k5k_matmul)
    size_t weight_bytes = in[1].nbytes();
    auto& team = pool();
    if (ggml_type >= 0) {
      // GGUF blocks through ggml's products, x rounded as they take it, output rows split as below
      const auto xq = ggml_quantize_x(ggml_type, xf.data(), R, K);
      const int parts = weight_bytes < kParallelBytes ? 1 : R < kPromptRows ? step_parts() : team.size();
      const int unit = 16, units = (N + unit - 1) / unit, chunks = parts == 1 ? 1 : std::min(units, 8 * parts);
      const auto* w = in[1].data<uint8_t>();
      team.run([&](int c) {
        int o0 = std::min(N, unit * (units * c / chunks)), o1 = std::min(N, unit * (units * (c + 1) / chunks));
        if (o0 < o1) ggml_rows_product(ggml_type, xq.data(), R, K, w, y, N, o0, o1);
      }, chunks, parts);
    } else if (bits == 0) {
      job.wtype = in[1].dtype() == mx::float32 ? WeightType::F32
                  : in[1].dtype() == mx::bfloat16 ? WeightType::BF16 : WeightType::F16;
    } else {
      job.wtype = bits == 4 ? WeightType::Affine4 : WeightType::Affine8;
      job.scales = in[2].data<void>();
      job.biases = k4 ? nullptr : in[3].data<void>();
      job.stype = k4 || k5 || k6 ? ScaleType::F32 : scale_type(in[2].dtype());
    }
    const Isa* isa = current().load();
    if ((k4 || k5 || k6) && !reads_k(bits)) {
      // packed K-quants where the set cannot read them so: each weight row dequantized, times x in float32
      const int parts = weight_bytes < kParallelBytes ? 1 : team.size();
      const int chunks = parts == 1 ? 1 : std::min(N / 8, 8 * parts);
      team.run([&](int c) {
        std::vector<float> row(K);
        for (int o = 8 * (N / 8 * c / chunks); o < 8 * (N / 8 * (c + 1) / chunks); ++o) {
          if (k4) k4_row(in[1].data<uint32_t>(), static_cast<const K4Fields*>(job.scales), K, o, row.data());
          else if (k5 && group == 256) k4_row(in[1].data<uint32_t>(), static_cast<const K4Fields*>(job.scales), K, o, row.data(), in[3].data<uint32_t>());
          else if (k5) k5_row(in[1].data<uint32_t>(), in[3].data<uint32_t>(), static_cast<const K5Fields*>(job.scales), K, o, row.data());
          else k6_row(in[1].data<uint32_t>(), in[3].data<uint32_t>(), static_cast<const K6Fields*>(job.scales), K, o, row.data());
          for (int r = 0; r < R; ++r) {
            const float* xr = xf.data() + size_t(r) * K;
            float sum = 0.0f;
            for (int k = 0; k < K; ++k) sum += xr[k] * row[k];
            y[size_t(r) * N + o] = sum;
          }
        }
      }, chunks, parts);
    } else if (ggml_type < 0) {  // the kernels' own products
      Scratch<int8_t> x8;
      Scratch<float> d8, xsg, usg;
      Scratch<int32_t> xs8;
      RowsFn rows = isa->rows;
      // Quantized weights times x in 8 bits, for any number of rows: each row's result is then the
      // same bits whatever else is in the product (a step's batch, a prompt chunk it joins), and a
      // prompt chunk runs as fast as through a GEMM of widened weights.
      const bool x8_path = bits != 0 && K % 64 == 0 && x_in_8_bits(*isa);
      // Packed weights: read as they are where the set can (rows_q4p, rows_q8p), else unpacked into
      // MLX's layout for this product (TURBOSPARK_KERNELS_EXACT, a set without integer products).
      const RowsFn packed_rows = k4 ? isa->rows_k4p : k5 ? isa->rows_k5p : k6 ? isa->rows_k6p
                                 : bits == 4 ? isa->rows_q4p : isa->rows_q8p;
      const bool packed_path = packed && x8_path && packed_rows != nullptr;
      std::vector<uint8_t> unpacked;
      if (packed && !packed_path) {
        const size_t wb = in[1].nbytes(), sb = in[2].nbytes();
        unpacked.resize(wb + 2 * sb);
        pack_q(in[1].data<uint8_t>(), in[2].data<uint8_t>(), in[3].data<uint8_t>(), int(in[2].itemsize()), N, K, group,
               bits, false, unpacked.data(), unpacked.data() + wb, unpacked.data() + wb + sb);
        job.w = unpacked.data();
        job.scales = unpacked.data() + wb;
        job.biases = unpacked.data() + wb + sb;
      }
      if (packed_path) {
        x8.resize(size_t(R) * K);
        d8.resize(size_t(R) * K / 32);
        xsg.resize(size_t(R) * (K / x_group));
        xs8.resize(bits == 8 ? size_t(R) * K / 32 : k6 ? size_t(R) * K / 16 : 0);
        isa->quantize_packed(xf.data(), R, K, x_group, bits != 8, x8.data(), d8.data(), xsg.data(),
                             bits == 8 ? xs8.data() : nullptr);
        if (k6)  // each 16's sum of x8 (its 16 values are the 32's first or second half, in any order)
          for (size_t i = 0; i < size_t(R) * K / 16; ++i) {
            int32_t sum = 0;
            for (int v = 0; v < 16; ++v) sum += x8.data()[16 * i + v];
            xs8.data()[i] = sum;
          }
        job.x8 = x8.data();
        job.d8 = d8.data();
        job.xsg = xsg.data();
        job.xs8 = xs8.data();
        rows = packed_rows;
      } else if (x8_path) {
        x8.resize(size_t(R) * K);
        d8.resize(size_t(R) * K / 8);
        xsg.resize(size_t(R) * (K / group));
        usg.resize(bits == 8 ? size_t(R) * (K / group) : 0);
        isa->quantize(xf.data(), R, K, group, bits == 4, x8.data(), d8.data(), xsg.data(), usg.data());
        job.x8 = x8.data();
        job.d8 = d8.data();
        job.xsg = xsg.data();
        job.usg = usg.data();
        rows = isa->rows_q8;
      }
      // A decode step's quantized products take step_parts() threads (the whole team unless set
      // otherwise); a prompt chunk's, and float weights (bound by reading memory), every core.
      int parts = weight_bytes < kParallelBytes ? 1 : bits != 0 && R < kPromptRows ? step_parts() : team.size();
      if (R >= kGemmRows && !x8_path && sgemm() != nullptr) {
        std::vector<float> block(size_t(kGemmBlock) * K);
        for (int o = 0; o < N; o += kGemmBlock) {
          int nb = std::min(kGemmBlock, N - o);
          isa->widen(job, o, o + nb, block.data());
          sgemm()(kRowMajor, kNoTrans, kTrans, R, nb, K, 1.0f, xf.data(), K, block.data(), K, 0.0f, y + o, N);
        }
      } else if (parts == 1) {
        rows(job, 0, N);
      } else {
        // chunks of output rows, in fours (packed weights: eights), about eight a thread
        const int unit = packed_path ? 8 : 4, units = (N + unit - 1) / unit, chunks = std::min(units, 8 * parts);
        team.run([&](int c) {
          int o0 = std::min(N, unit * (units * c / chunks));
          int o1 = std::min(N, unit * (units * (c + 1) / chunks));
          if (o0 < o1) rows(job, o0, o1);
        }, chunks, parts);
      }
    }
    if (has_bias) {  // row by row (a prompt's rows: one pass over y, not one a column)
      const auto& b = in[bits == 0 ? 2 : k4 ? 3 : 4];
      static thread_local std::vector<float> bias;  // a decode step's products: no allocation each
      bias.resize(N);
      for (int o = 0; o < N; ++o) bias[o] = scalar_at(b, o);
      for (int r = 0; r < R; ++r) {
        float* yr = y + size_t(r) * N;
        for (int o = 0; o < N; ++o) yr[o] += bias[o];
      }
    }
    if (!direct) {
      const mx::array* residual = epilogue == Epilogue::Residual ? &in[in.size() - 1 - has_norm] : nullptr;
      if (out.dtype() == mx::float32) finish<float>(y, R, N, epilogue, residual, out);
      else if (out.dtype() == mx::bfloat16) finish<mx::bfloat16_t>(y, R, N, epilogue, residual, out);
      else finish<mx::float16_t>(y, R, N, epilogue, residual, out);
    }
  };
  enqueue(stream(), inputs, out, std::move(work));
}

} // namespace turbospark::kernels

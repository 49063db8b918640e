#include "ggml_blocks.h"

#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <stdexcept>

#include "mlx/ops.h"
#include "mlx/types/half_types.h"
#include "enqueue.h"
#include "kquants.h"
#include "rows_kernels.h"
#include "strided.h"

namespace turbospark::kernels {

namespace {

// ggml's public types, as ggml.h and ggml-cpu.h of the pinned build declare them (ggml 0.25.3,
// llama-cpp-python 0.3.36): the libraries are opened at run time, so their headers are not needed
// to build the kernels.  test_ggml_blocks checks the sizes they give against gguf's table.
using ToFloat = void (*)(const void* x, float* y, int64_t k);
using FromFloat = void (*)(const float* x, void* y, int64_t k);
using VecDot = void (*)(int n, float* s, size_t bs, const void* x, size_t bx, const void* y, size_t by, int nrc);
struct TypeTraits {
  const char* type_name;
  int64_t blck_size;
  int64_t blck_size_interleave;
  size_t type_size;
  bool is_quantized;
  ToFloat to_float;
  FromFloat from_float_ref;
};
struct TypeTraitsCpu {
  FromFloat from_float;
  VecDot vec_dot;
  int vec_dot_type;
  int64_t nrows;
};
using GetTraits = const TypeTraits* (*)(int);
using GetTraitsCpu = const TypeTraitsCpu* (*)(int);
using QuantizeChunk = size_t (*)(int type, const float* src, void* dst, int64_t start, int64_t nrows,
                                 int64_t n_per_row, const float* imatrix);
using QuantizeRequiresImatrix = bool (*)(int type);

constexpr int kTypeCount = 43;  // GGML_TYPE_COUNT
constexpr int kF32 = 0, kF16 = 1, kBF16 = 30;

struct Variant {
  std::string isa;   // the kernels' instruction set it serves
  std::string name;  // ggml's name for it: haswell, alderlake, icelake, x64...
  GetTraitsCpu traits = nullptr;
};

struct Library {
  std::mutex m;
  bool open = false;
  GetTraits traits = nullptr;
  QuantizeChunk quantize = nullptr;
  QuantizeRequiresImatrix needs_imatrix = nullptr;
  std::vector<Variant> variants;
};

Library& lib() {
  static Library* l = new Library();
  return *l;
}

// ggml's CPU variant built for each of the kernels' instruction sets (scripts/setup builds these)
const char* variant_name(const std::string& isa) {
  if (isa == "avx2+avx512vnni") return "icelake";
  if (isa == "avx2+vnni") return "alderlake";
  if (isa == "avx2+fma") return "haswell";
#if defined(__aarch64__)
  return "armv8.0_1";
#else
  return "x64";
#endif
}

const Variant* active_variant() {
  auto& l = lib();
  if (!l.open) return nullptr;
  const char* name = active_isa().name;
  for (auto& v : l.variants)
    if (v.isa == name) return &v;
  return nullptr;
}

// The CPU traits of `type` where ggml multiplies it (a product and x's rounding), else null.
const TypeTraitsCpu* cpu_traits(int type) {
  const Variant* v = active_variant();
  if (v == nullptr || type < 0 || type >= kTypeCount || type == kF32) return nullptr;
  const TypeTraits* t = lib().traits(type);
  const TypeTraitsCpu* c = v->traits(type);
  if (t == nullptr || c == nullptr || c->vec_dot == nullptr || t->to_float == nullptr || t->blck_size <= 0) return nullptr;
  const TypeTraitsCpu* x = v->traits(c->vec_dot_type);
  if (x == nullptr || x->from_float == nullptr) return nullptr;
  return c;
}

const TypeTraits& traits_of(int type) {
  if (!lib().open || type < 0 || type >= kTypeCount) throw std::invalid_argument("[ggml] no such type");
  return *lib().traits(type);
}

size_t row_size(int type, int K) {
  const TypeTraits& t = traits_of(type);
  return size_t(K / t.blck_size) * t.type_size;
}

} // namespace

std::string ggml_open(const std::string& dir) {
  auto& l = lib();
  std::lock_guard<std::mutex> lock(l.m);
  if (l.open) return "";
  // The base library first: the variants need it by its soname, and find it already loaded.
  void* base = dlopen((dir + "/libggml-base.so.0").c_str(), RTLD_NOW | RTLD_LOCAL);
  if (base == nullptr) return std::string("no ggml in ") + dir + " (scripts/setup builds it)";
  l.traits = reinterpret_cast<GetTraits>(dlsym(base, "ggml_get_type_traits"));
  l.quantize = reinterpret_cast<QuantizeChunk>(dlsym(base, "ggml_quantize_chunk"));
  l.needs_imatrix = reinterpret_cast<QuantizeRequiresImatrix>(dlsym(base, "ggml_quantize_requires_imatrix"));
  if (l.traits == nullptr || l.quantize == nullptr) return "libggml-base.so is not the ggml this build reads";
  std::string missing;
  for (const auto& isa : isas()) {
    const char* name = variant_name(isa);
    void* h = dlopen((dir + "/libggml-cpu-" + name + ".so").c_str(), RTLD_NOW | RTLD_LOCAL);
    auto traits = h ? reinterpret_cast<GetTraitsCpu>(dlsym(h, "ggml_get_type_traits_cpu")) : nullptr;
    auto init = h ? reinterpret_cast<void (*)()>(dlsym(h, "ggml_cpu_init")) : nullptr;
    if (traits == nullptr || init == nullptr) {
      missing += std::string(missing.empty() ? "" : ", ") + name;
      continue;
    }
    init();
    l.variants.push_back({isa, name, traits});
  }
  if (l.variants.empty()) return "no ggml CPU variant for this CPU in " + dir + " (missing: " + missing + ")";
  l.open = true;
  return "";
}

bool ggml_ready() { return active_variant() != nullptr; }

std::string ggml_variant() {
  const Variant* v = active_variant();
  return v ? v->name : "";
}

size_t ggml_row_bytes(int type, int K) {
  if (cpu_traits(type) == nullptr || K % traits_of(type).blck_size != 0) return 0;
  return row_size(type, K);
}

std::string ggml_type_name(int type) { return traits_of(type).type_name; }

std::vector<uint8_t> ggml_quantize_x(int type, const float* x, int R, int K) {
  const TypeTraitsCpu* c = cpu_traits(type);
  const int xt = c->vec_dot_type;
  const size_t xrow = row_size(xt, K);
  std::vector<uint8_t> xq(xrow * R);
  if (xt == kF32) {
    std::memcpy(xq.data(), x, sizeof(float) * size_t(R) * K);
    return xq;
  }
  const TypeTraitsCpu* xc = active_variant()->traits(xt);
  for (int r = 0; r < R; ++r) xc->from_float(x + size_t(r) * K, xq.data() + xrow * r, K);
  return xq;
}

void ggml_rows_product(int type, const uint8_t* xq, int R, int K, const uint8_t* w, float* y, int ldy, int o0,
                       int o1) {
  const TypeTraitsCpu* c = cpu_traits(type);
  const size_t wrow = row_size(type, K), xrow = row_size(c->vec_dot_type, K);
  // a block of output rows stays in L1 while every row of x passes over it
  constexpr int kBlock = 16;
  for (int ob = o0; ob < o1; ob += kBlock) {
    const int oe = std::min(o1, ob + kBlock);
    for (int r = 0; r < R; ++r)
      for (int o = ob; o < oe; ++o)
        c->vec_dot(K, y + size_t(r) * ldy + o, 0, w + wrow * o, 0, xq + xrow * r, 0, 1);
  }
}

mx::array ggml_take_rows(const mx::array& table, const mx::array& ids, int type, int K, mx::Dtype dtype,
                         mx::StreamOrDevice s) {
  if (!lib().open || type < 0 || type >= kTypeCount || traits_of(type).to_float == nullptr)
    throw std::invalid_argument("[ggml_take_rows] a type ggml cannot read");
  if (table.dtype() != mx::uint8 || table.ndim() != 2 || size_t(table.shape(1)) != row_size(type, K))
    throw std::invalid_argument("[ggml_take_rows] the table must be (V, row bytes) uint8 of its type");
  if (dtype != mx::float32 && dtype != mx::bfloat16 && dtype != mx::float16)
    throw std::invalid_argument("[ggml_take_rows] rows come as float32, bfloat16 or float16");
  auto stream = mx::to_stream(s);
  auto shape = ids.shape();
  shape.push_back(K);
  auto t = table.flags().row_contiguous ? table : mx::contiguous(table, false, stream);
  return mx::array(std::move(shape), dtype, std::make_shared<GgmlRows>(stream, type, K),
                   {t, mx::contiguous(mx::astype(ids, mx::int32, stream), false, stream)});
}

namespace {
// one looked-up row (float32) into row i of out, in out's type
void put_row(const float* row, int K, size_t i, mx::array& out) {
  switch (out.dtype()) {
    case mx::float32:
      std::memcpy(out.data<float>() + i * K, row, sizeof(float) * K);
      break;
    case mx::bfloat16:
      for (int k = 0; k < K; ++k) out.data<mx::bfloat16_t>()[i * K + k] = mx::bfloat16_t(row[k]);
      break;
    default:
      for (int k = 0; k < K; ++k) out.data<mx::float16_t>()[i * K + k] = mx::float16_t(row[k]);
  }
}
} // namespace

mx::array k6_take_rows(const mx::array& w, const mx::array& highs, const mx::array& fields, const mx::array& ids,
                       mx::Dtype dtype, mx::StreamOrDevice s) {
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || w.shape(0) % 8 != 0 || (w.shape(1) * 8) % 256 != 0)
    throw std::invalid_argument("[k6_take_rows] w must be (N, K / 8) uint32");
  const int N = w.shape(0), K = w.shape(1) * 8;
  if (highs.dtype() != mx::uint32 || highs.shape() != mx::Shape{N, K / 16} || fields.dtype() != mx::uint8 ||
      fields.size() != size_t(N / 8) * (K / 256) * sizeof(K6Fields))
    throw std::invalid_argument("[k6_take_rows] highs and fields must be pack_k6's");
  if (dtype != mx::float32 && dtype != mx::bfloat16 && dtype != mx::float16)
    throw std::invalid_argument("[k6_take_rows] rows come as float32, bfloat16 or float16");
  auto stream = mx::to_stream(s);
  auto shape = ids.shape();
  shape.push_back(K);
  return mx::array(std::move(shape), dtype, std::make_shared<K6Rows>(stream, K),
                   {mx::contiguous(w, false, stream), mx::contiguous(highs, false, stream),
                    mx::contiguous(mx::flatten(fields, stream), false, stream),
                    mx::contiguous(mx::astype(ids, mx::int32, stream), false, stream)});
}

void K6Rows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  enqueue(stream(), inputs, out, [K = K_](std::vector<mx::array>& in, mx::array& out) {
    const int N = in[0].shape(0);
    std::vector<float> row(K);
    const int32_t* ids = in[3].data<int32_t>();
    for (size_t i = 0; i < in[3].size(); ++i) {
      if (ids[i] < 0 || ids[i] >= N) std::fill(row.begin(), row.end(), 0.0f);
      else k6_row(in[0].data<uint32_t>(), in[1].data<uint32_t>(), reinterpret_cast<const K6Fields*>(in[2].data<uint8_t>()),
                  K, ids[i], row.data());
      put_row(row.data(), K, i, out);
    }
  });
}

void K6Rows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[K6Rows] runs on the CPU only");
}

std::vector<mx::Shape> K6Rows::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[3].shape();
  shape.push_back(K_);
  return {shape};
}

void GgmlRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  enqueue(stream(), inputs, out, [type = type_, K = K_](std::vector<mx::array>& in, mx::array& out) {
    const auto& table = in[0];
    const int V = table.shape(0);
    const size_t wrow = table.shape(1);
    const ToFloat to_float = traits_of(type).to_float;
    std::vector<float> row(K);
    const int32_t* ids = in[1].data<int32_t>();
    for (size_t i = 0; i < in[1].size(); ++i) {
      const int id = ids[i];
      if (id < 0 || id >= V) {
        std::fill(row.begin(), row.end(), 0.0f);
      } else {
        to_float(table.data<uint8_t>() + wrow * id, row.data(), K);
      }
      put_row(row.data(), K, i, out);
    }
  });
}

void GgmlRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[GgmlRows] runs on the CPU only");
}

bool GgmlRows::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const GgmlRows&>(other);
  return type_ == o.type_ && K_ == o.K_;
}

std::vector<mx::Shape> GgmlRows::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[1].shape();
  shape.push_back(K_);
  return {shape};
}

mx::array ggml_quantize(const mx::array& values, int type) {
  if (!lib().open || type < 0 || type >= kTypeCount) throw std::invalid_argument("[ggml_quantize] no such type");
  if (values.ndim() != 2) throw std::invalid_argument("[ggml_quantize] values must be (N, K)");
  if (lib().needs_imatrix != nullptr && lib().needs_imatrix(type))
    throw std::invalid_argument("[ggml_quantize] this type needs an importance matrix");
  const int N = values.shape(0), K = values.shape(1);
  if (K % traits_of(type).blck_size != 0) throw std::invalid_argument("[ggml_quantize] K is not a multiple of the block");
  auto v = mx::contiguous(mx::astype(values, mx::float32));
  v.eval();
  const size_t rb = row_size(type, K);
  auto* p = static_cast<uint8_t*>(std::malloc(std::max<size_t>(rb * N, 1)));
  lib().quantize(type, v.data<float>(), p, 0, N, K, nullptr);
  return mx::array(p, {N, int(rb)}, mx::uint8, [](void* q) { std::free(q); });
}

mx::array ggml_dequantize(const mx::array& blocks, int type, int K) {
  const TypeTraits& t = traits_of(type);
  if (t.to_float == nullptr || blocks.dtype() != mx::uint8 || blocks.ndim() != 2 ||
      size_t(blocks.shape(1)) != row_size(type, K))
    throw std::invalid_argument("[ggml_dequantize] blocks must be (N, row bytes) uint8 of a type ggml reads");
  auto b = mx::contiguous(blocks);
  b.eval();
  const int N = blocks.shape(0);
  auto* p = static_cast<float*>(std::malloc(std::max<size_t>(sizeof(float) * N * K, 1)));
  for (int n = 0; n < N; ++n) t.to_float(b.data<uint8_t>() + row_size(type, K) * n, p + size_t(n) * K, K);
  return mx::array(p, {N, K}, mx::float32, [](void* q) { std::free(q); });
}

} // namespace turbospark::kernels

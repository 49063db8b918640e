#include "fused.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "mlx/backend/common/utils.h"
#include "mlx/ops.h"
#include "mlx/types/half_types.h"
#include "enqueue.h"
#include "norm.h"
#include "pool.h"
#include "round.h"
#include "rows.h"
#include "strided.h"
#include "rows_kernels.h"

namespace turbospark::kernels {

namespace {

using mx::bfloat16_t;
using mx::float16_t;

// Calls f with a value of the array's float type (float, bfloat16_t or float16_t).
template <class F>
void by_type(mx::Dtype t, F&& f) {
  if (t == mx::float32) {
    f(float{});
  } else if (t == mx::bfloat16) {
    f(bfloat16_t{});
  } else if (t == mx::float16) {
    f(float16_t{});
  } else {
    throw std::invalid_argument("[turbospark kernels] expected float32, bfloat16 or float16");
  }
}

// Element (i0, i1, i2, i3) of an array of up to 4 dimensions, by its strides.
struct View4 {
  const char* data;
  mx::Dtype dtype;
  int64_t st[4];
  template <class T>
  T at(int64_t a, int64_t b, int64_t c, int64_t d) const {
    return reinterpret_cast<const T*>(data)[a * st[0] + b * st[1] + c * st[2] + d * st[3]];
  }
};

View4 view4(const mx::array& a) {
  View4 v{a.data<char>(), a.dtype(), {0, 0, 0, 0}};
  int nd = int(a.ndim());
  for (int i = 0; i < nd; ++i) v.st[4 - nd + i] = a.strides(i);
  return v;
}

void check_cpu(const mx::Stream& s, const char* what) {
  if (s.device != mx::Device::cpu) throw std::invalid_argument(std::string(what) + " runs on the CPU only");
}

} // namespace

// ---------------------------------------------------------------------------------------- RMSNorm

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps, mx::StreamOrDevice s_) {
  auto s = mx::to_stream(s_);
  check_cpu(s, "[rms_norm]");
  if (x.ndim() == 0) throw std::invalid_argument("[rms_norm] x must have at least 1 dimension");
  auto out_type = weight ? mx::result_type(x, *weight) : x.dtype();
  if (out_type != mx::float32 && out_type != mx::bfloat16 && out_type != mx::float16)
    throw std::invalid_argument("[rms_norm] expected float32, bfloat16 or float16");
  if (weight && (weight->ndim() != 1 || weight->shape(0) != x.shape(-1)))
    throw std::invalid_argument("[rms_norm] weight must be (D,) for x (..., D)");
  std::vector<mx::array> inputs{mx::astype(x, out_type, s)};
  if (weight) inputs.push_back(mx::astype(*weight, out_type, s));
  return mx::array(x.shape(), out_type, std::make_shared<RmsNorm>(s, eps, bool(weight)), std::move(inputs));
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[TurbosparkRmsNorm] runs on the CPU only");
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const RmsNorm&>(other);
  return eps_ == o.eps_ && has_weight_ == o.has_weight_;
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  enqueue(stream(), inputs, out, [eps = eps_, has_weight = has_weight_](std::vector<mx::array>& in, mx::array& out) {
    by_type(out.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const auto& x = in[0];
      const int D = x.shape(-1);
      const int R = D == 0 ? 0 : int(x.size() / D);
      const int64_t s1 = x.strides().back();
      const T* xp = x.data<T>();
      const T* wp = has_weight ? in[1].data<T>() : nullptr;
      const int64_t ws = has_weight ? in[1].strides(0) : 0;
      T* op = out.data<T>();
      for (int r = 0; r < R; ++r) {
        const T* row = xp + row_offset(x, r);
        T* o = op + size_t(r) * D;
        rms_norm_row<T>(D, eps, wp, ws, [&](int d) { return static_cast<float>(row[d * s1]); },
                        [&](int d, T v) { o[d] = v; });
      }
    });
  });
}

// ------------------------------------------------------------------------------------------- RoPE

mx::array rope(const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale,
               const mx::array& offset, const std::optional<mx::array>& freqs, mx::StreamOrDevice s_) {
  auto s = mx::to_stream(s_);
  check_cpu(s, "[rope]");
  if (x.ndim() < 3) throw std::invalid_argument("[rope] x must have at least 3 dimensions");
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1))
    throw std::invalid_argument("[rope] dims must be even, positive and at most x's last dimension");
  if (offset.ndim() > 1 || (offset.size() != 1 && offset.size() != size_t(x.shape(0))))
    throw std::invalid_argument("[rope] offset must be a scalar or one per batch row");
  if (bool(freqs) == bool(base)) throw std::invalid_argument("[rope] exactly one of base and freqs");
  if (freqs && (freqs->ndim() != 1 || freqs->shape(0) != dims / 2))
    throw std::invalid_argument("[rope] freqs must be (dims / 2,)");
  auto shape = x.shape();
  int B = shape[0], T = shape[shape.size() - 2], D = shape.back();
  int N = int(x.size() / (size_t(B) * T * D));
  // (B, T, D) and (B, N, T, D) are read as they are; more dimensions are folded into N
  auto xin = x.ndim() <= 4 ? x : mx::reshape(x, {B, N, T, D}, s);
  auto off = offset.ndim() == 1 && offset.dtype() == mx::int32 ? offset : mx::astype(mx::reshape(offset, {-1}, s), mx::int32, s);
  std::vector<mx::array> inputs{xin, off};
  if (freqs) inputs.push_back(mx::astype(*freqs, mx::float32, s));
  auto out = mx::array(xin.shape(), x.dtype(),
                       std::make_shared<Rope>(s, dims, traditional, base ? *base : 1.0f, scale, bool(freqs)),
                       std::move(inputs));
  return x.ndim() <= 4 ? out : mx::reshape(out, shape, s);
}

void Rope::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[TurbosparkRope] runs on the CPU only");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_ &&
         has_freqs_ == o.has_freqs_;
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  enqueue(stream(), inputs, out, [dims = dims_, traditional = traditional_,
                base = base_, scale = scale_, has_freqs = has_freqs_](std::vector<mx::array>& in, mx::array& out) {
    by_type(out.dtype(), [&](auto zero) {
      using T = decltype(zero);
      const auto& x = in[0];
      const bool three = x.ndim() == 3;  // (B, T, D): one head
      const int B = x.shape(0), N = three ? 1 : x.shape(1), L = x.shape(-2), D = x.shape(-1), half = dims / 2;
      View4 xv = view4(x);
      if (three) xv = View4{xv.data, xv.dtype, {xv.st[1], 0, xv.st[2], xv.st[3]}};
      const int32_t* off = in[1].data<int32_t>();
      const bool per_row = in[1].size() > 1;
      std::vector<float> inv(half);
      if (has_freqs) {
        for (int i = 0; i < half; ++i) inv[i] = 1.0f / in[2].data<float>()[i * in[2].strides(0)];
      } else {
        const float c = std::log(base) / float(half);
        for (int i = 0; i < half; ++i) inv[i] = std::exp(float(-i) * c);
      }
      std::vector<float> cs(half), sn(half);
      T* op = out.data<T>();
      for (int b = 0; b < B; ++b) {
        const float o = float(off[per_row ? b * in[1].strides(0) : 0]);
        for (int t = 0; t < L; ++t) {
          const float pos = (float(t) + o) * scale;
          for (int i = 0; i < half; ++i) {
            const float theta = pos * inv[i];
            cs[i] = round_to<T>(std::cos(theta));
            sn[i] = round_to<T>(std::sin(theta));
          }
          for (int n = 0; n < N; ++n) {
            T* row = op + ((size_t(b) * N + n) * L + t) * D;
            for (int i = 0; i < half; ++i) {
              const int a = traditional ? 2 * i : i, c = traditional ? 2 * i + 1 : i + half;
              const float x1 = static_cast<float>(xv.at<T>(b, n, t, a));
              const float x2 = static_cast<float>(xv.at<T>(b, n, t, c));
              row[a] = static_cast<T>(round_to<T>(x1 * cs[i]) - round_to<T>(x2 * sn[i]));
              row[c] = static_cast<T>(round_to<T>(x1 * sn[i]) + round_to<T>(x2 * cs[i]));
            }
            for (int d = dims; d < D; ++d) row[d] = xv.at<T>(b, n, t, d);
          }
        }
      }
    });
  });
}

// -------------------------------------------------------------------------------------- Attention

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::string& mask_mode, const std::optional<mx::array>& mask,
                    const std::optional<mx::array>& sinks, bool merged, mx::StreamOrDevice s_) {
  auto s = mx::to_stream(s_);
  check_cpu(s, "[attention]");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    throw std::invalid_argument("[attention] q, k and v must be (B, H, L, D)");
  // keys and values in blocks (a quantized KV cache) under float32 queries: read as they are
  const int kv_fmt = kv_format(k.dtype());
  if (kv_fmt != kv_format(v.dtype()) || (kv_fmt && (q.dtype() != mx::float32 || q.shape(3) % 32 != 0 ||
                                                     q.shape(3) > kMaxBlockedHead)))
    throw std::invalid_argument("[attention] keys and values in blocks take float32 queries, heads of 32-512");
  const int key_size = kv_fmt ? q.shape(3) / 32 * kv_block_bytes(kv_fmt) : q.shape(3);
  if (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || k.shape(1) != v.shape(1) || k.shape(2) != v.shape(2) ||
      k.shape(3) != key_size || (kv_fmt && v.shape(3) % kv_block_bytes(kv_fmt) != 0) || q.shape(1) % k.shape(1) != 0)
    throw std::invalid_argument("[attention] q, k and v do not fit together");
  const int Dv = kv_fmt ? v.shape(3) / kv_block_bytes(kv_fmt) * 32 : v.shape(3);
  bool causal = mask_mode == "causal";
  if (!mask_mode.empty() && !causal && mask_mode != "array")
    throw std::invalid_argument("[attention] mask_mode must be '', 'causal' or 'array'");
  // float32 queries over a float16 KV cache read the cache as it is (widened as it is read)
  const bool half_kv = q.dtype() == mx::float32 && k.dtype() == mx::float16 && v.dtype() == mx::float16;
  auto type = kv_fmt ? mx::float32 : mx::result_type(q, k, v);
  auto kv_type = half_kv ? mx::float16 : type;
  std::vector<mx::array> inputs{mx::astype(q, type, s), kv_fmt ? k : mx::astype(k, kv_type, s),
                                kv_fmt ? v : mx::astype(v, kv_type, s)};
  bool has_mask = !causal && mask.has_value();
  if (has_mask) {
    auto m = mask->dtype() == mx::bool_ ? *mask : mx::astype(*mask, type, s);
    inputs.push_back(mx::broadcast_to(m, {q.shape(0), q.shape(1), q.shape(2), k.shape(2)}, s));
  }
  if (sinks) {
    if (sinks->ndim() != 1 || sinks->shape(0) != q.shape(1)) throw std::invalid_argument("[attention] sinks must be (Hq,)");
    inputs.push_back(mx::astype(*sinks, type, s));
  }
  mx::Shape shape = merged ? mx::Shape{q.shape(0), q.shape(2), q.shape(1) * Dv}
                           : mx::Shape{q.shape(0), q.shape(1), q.shape(2), Dv};
  return mx::array(shape, type, std::make_shared<Attention>(s, scale, causal, has_mask, bool(sinks), merged, kv_fmt),
                   std::move(inputs));
}

void Attention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[TurbosparkAttention] runs on the CPU only");
}

bool Attention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Attention&>(other);
  return scale_ == o.scale_ && causal_ == o.causal_ && has_mask_ == o.has_mask_ && has_sinks_ == o.has_sinks_ &&
         merged_ == o.merged_ && kv_fmt_ == o.kv_fmt_;
}

int kv_format(mx::Dtype t) { return t == mx::int8 ? 1 : t == mx::uint8 ? 2 : 0; }

std::vector<mx::Shape> Attention::output_shapes(const std::vector<mx::array>& inputs) {
  auto& q = inputs[0];
  const int Dv = kv_fmt_ ? inputs[2].shape(3) / kv_block_bytes(kv_fmt_) * 32 : inputs[2].shape(3);
  if (merged_) return {mx::Shape{q.shape(0), q.shape(2), q.shape(1) * Dv}};
  return {mx::Shape{q.shape(0), q.shape(1), q.shape(2), Dv}};
}

namespace {

// One query row's attention: scores over the keys it may see, softmax in float32, the weighted
// sum of values.  Rounds where the MLX fallback's ops round (their outputs are T).  A unit is the
// G query heads that share one key/value head (grouped-query attention), so each key and value
// row is read once for all of them.  KT: the keys' and values' type (T, or float16 under float32
// queries: a half-precision KV cache).
template <class T, class KT = T>
struct AttentionJob {
  View4 q, k, v, m;
  bool causal, has_mask, bool_mask, has_sinks;
  const T* sinks;
  int64_t sinks_stride;
  float scale;
  int Hq, Hkv, Lq, Lk, D, Dv;
  T* out;
  bool merged;  // out is (B, Lq, Hq * Dv), else (B, Hq, Lq, Dv)
  int kv_fmt = 0;  // keys and values in blocks of 32 (KT uint8_t: kv_format's 1 or 2)

  // rows (b, h, i) for the G heads from h0 (all of one key/value head), i in [i0, i1)
  void run(int b, int h0, int G, int i0, int i1, const Isa& isa) const {
    const int kvh = h0 / (Hq / Hkv);
    thread_local std::vector<float> kf, vf, qf, scores, acc;
    // keys and values of this head as float32 rows, or float16 ones (read in place where they
    // already are)
    const float *kp = nullptr, *vp = nullptr;
    const uint16_t *kh = nullptr, *vh = nullptr;
    const uint8_t *kb = nullptr, *vb = nullptr;  // rows in blocks of 32, read as they are
    int64_t kst, vst;
    auto rows_of = [&](const View4& a, int n, int d, std::vector<float>& buf, const float*& p, const uint16_t*& h,
                       int64_t& st) {
      if constexpr (std::is_same_v<KT, uint8_t>) {
        (void)n, (void)d, (void)buf, (void)p, (void)h;
        if (a.st[3] != 1) throw std::runtime_error("[attention] a row of blocks must be contiguous");
        (&a == &k ? kb : vb) = reinterpret_cast<const uint8_t*>(a.data) + b * a.st[0] + kvh * a.st[1];
        st = a.st[2];
        return;
      }
      if (a.st[3] == 1) {
        if constexpr (std::is_same_v<KT, float>) {
          p = reinterpret_cast<const float*>(a.data) + b * a.st[0] + kvh * a.st[1];
          st = a.st[2];
          return;
        } else if constexpr (std::is_same_v<KT, float16_t>) {
          h = reinterpret_cast<const uint16_t*>(a.data) + b * a.st[0] + kvh * a.st[1];
          st = a.st[2];
          return;
        }
      }
      buf.resize(size_t(n) * d);
      for (int j = 0; j < n; ++j)
        for (int e = 0; e < d; ++e) buf[size_t(j) * d + e] = static_cast<float>(a.at<KT>(b, kvh, j, e));
      p = buf.data();
      st = d;
    };
    rows_of(k, Lk, D, kf, kp, kh, kst);
    rows_of(v, Lk, Dv, vf, vp, vh, vst);
    qf.resize(size_t(G) * D);
    scores.resize(size_t(G) * Lk);
    acc.resize(size_t(G) * Dv);
    const float lowest = std::numeric_limits<float>::lowest();
    // finfo(T).min, what the fallback writes where the mask says no
    const float masked = std::is_same_v<T, float> ? lowest : std::is_same_v<T, bfloat16_t> ? -3.38953139e38f : -65504.0f;
    for (int i = i0; i < i1; ++i) {
      for (int g = 0; g < G; ++g)
        for (int e = 0; e < D; ++e) qf[size_t(g) * D + e] = round_to<T>(scale * static_cast<float>(q.at<T>(b, h0 + g, i, e)));
      const int visible = causal ? std::min(Lk, i + 1 + (Lk - Lq)) : Lk;
      // keys a boolean mask hides from every head of the unit before the first it shows (a
      // batch cache's left padding) weigh exactly 0: they are skipped, the result the same bits
      int from = 0;
      if (has_mask && bool_mask) {
        from = visible;
        for (int g = 0; g < G; ++g) {
          int j = 0;
          while (j < from && !m.at<bool>(b, h0 + g, i, j)) ++j;
          from = j;
        }
        if (from == visible) from = 0;  // none shown: the whole row, as MLX weighs it
      }
      if (kb)
        isa.dots_b(kv_fmt, qf.data(), G, D, kb + from * kst, kst, visible - from, D, scores.data() + from, Lk);
      else if (kh)
        isa.dots_h(qf.data(), G, D, kh + from * kst, kst, visible - from, D, scores.data() + from, Lk);
      else
        isa.dots(qf.data(), G, D, kp + from * kst, kst, visible - from, D, scores.data() + from, Lk);
      for (int g = 0; g < G; ++g) {
        const int h = h0 + g;
        float* sg = scores.data() + size_t(g) * Lk;
        float top = has_sinks ? static_cast<float>(sinks[h * sinks_stride]) : lowest;
        for (int j = from; j < visible; ++j) {
          float sc = round_to<T>(sg[j]);
          if (has_mask) {
            if (bool_mask) {
              if (!m.at<bool>(b, h, i, j)) sc = masked;
            } else {
              sc = round_to<T>(sc + static_cast<float>(m.at<T>(b, h, i, j)));
            }
          }
          sg[j] = sc;
          top = std::max(top, sc);
        }
        float total = 0.0f;
        if (has_sinks) {
          float sink = static_cast<float>(sinks[h * sinks_stride]) - top;
          isa.exps(&sink, 1);
          total = sink;
        }
        for (int j = from; j < visible; ++j) sg[j] -= top;
        isa.exps(sg + from, visible - from);  // MLX's own exp, as its softmax takes it
        for (int j = from; j < visible; ++j) total += sg[j];
        for (int j = from; j < visible; ++j) sg[j] = round_to<T>(sg[j] / total);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (vb)
        isa.axpys_b(kv_fmt, scores.data() + from, G, Lk, vb + from * vst, vst, visible - from, Dv, acc.data(), Dv);
      else if (vh)
        isa.axpys_h(scores.data() + from, G, Lk, vh + from * vst, vst, visible - from, Dv, acc.data(), Dv);
      else
        isa.axpys(scores.data() + from, G, Lk, vp + from * vst, vst, visible - from, Dv, acc.data(), Dv);
      for (int g = 0; g < G; ++g) {
        const int h = h0 + g;
        T* o = merged ? out + ((size_t(b) * Lq + i) * Hq + h) * Dv : out + ((size_t(b) * Hq + h) * Lq + i) * Dv;
        for (int e = 0; e < Dv; ++e) o[e] = static_cast<T>(acc[size_t(g) * Dv + e]);
      }
    }
  }
};

// Below this many multiply-adds an attention runs on one thread.
constexpr size_t kParallelWork = 1 << 16;

template <class T, class KT>
void run_attention(const std::vector<mx::array>& in, mx::array& out, float scale, bool causal, bool has_mask,
                   bool has_sinks, bool merged, int kv_fmt = 0) {
  const auto &q = in[0], &k = in[1], &v = in[2];
  const int Dv = kv_fmt ? v.shape(3) / kv_block_bytes(kv_fmt) * 32 : v.shape(3);
  AttentionJob<T, KT> job{view4(q), view4(k), view4(v), has_mask ? view4(in[3]) : View4{nullptr, mx::bool_, {0, 0, 0, 0}},
                          causal, has_mask, has_mask && in[3].dtype() == mx::bool_, has_sinks,
                          has_sinks ? in.back().data<T>() : nullptr, has_sinks ? in.back().strides(0) : 0, scale,
                          q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3), Dv, out.data<T>(),
                          merged, kv_fmt};
  const int B = q.shape(0);
  // units: (b, the query heads of a key/value head, a block of up to 16 query rows), each
  // key and value row read once for the heads that share it; one head a unit where that
  // would leave too few units to share out (one sequence's decode step)
  const int blocks = (job.Lq + 15) / 16;
  auto& team = pool();
  const int threads = job.Lq >= 16 ? team.size() : step_parts();
  const int G = B * job.Hkv * blocks >= 4 * threads ? job.Hq / job.Hkv : 1;
  const int groups = job.Hq / G;
  const int units = B * groups * blocks;
  const Isa& isa = active_isa();
  auto unit = [&](int u) {
    int blk = u % blocks, bh = u / blocks;
    job.run(bh / groups, (bh % groups) * G, G, blk * 16, std::min(job.Lq, blk * 16 + 16), isa);
  };
  size_t work = size_t(B) * job.Hq * job.Lq * job.Lk * (job.D + job.Dv);
  const int parts = std::min(units, threads);
  if (work < kParallelWork || parts == 1) {
    for (int u = 0; u < units; ++u) unit(u);
  } else {
    team.run(unit, units, parts);
  }
}

} // namespace

void Attention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  enqueue(stream(), inputs, out, [scale = scale_, causal = causal_, has_mask = has_mask_, has_sinks = has_sinks_,
                merged = merged_, kv_fmt = kv_fmt_](std::vector<mx::array>& in, mx::array& out) {
    if (kv_fmt) return run_attention<float, uint8_t>(in, out, scale, causal, has_mask, has_sinks, merged, kv_fmt);
    by_type(out.dtype(), [&](auto zero) {
      using T = decltype(zero);
      if constexpr (std::is_same_v<T, float>) {
        if (in[1].dtype() == mx::float16) return run_attention<float, float16_t>(in, out, scale, causal, has_mask, has_sinks, merged);
      }
      run_attention<T, T>(in, out, scale, causal, has_mask, has_sinks, merged);
    });
  });
}

// ------------------------------------------------------------------------------------- LogSumExp

mx::array logsumexp(const mx::array& x, mx::StreamOrDevice s_) {
  auto s = mx::to_stream(s_);
  check_cpu(s, "[logsumexp]");
  if (x.ndim() == 0 || x.dtype() != mx::float32)
    throw std::invalid_argument("[logsumexp] expected float32 x of at least 1 dimension");
  if (x.size() == 0) throw std::invalid_argument("[logsumexp] Received empty array.");  // as MLX's
  auto shape = x.shape();
  shape.back() = 1;
  return mx::array(std::move(shape), mx::float32, std::make_shared<LogSumExp>(s), {x});
}

std::vector<mx::Shape> LogSumExp::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = 1;
  return {shape};
}

void LogSumExp::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[TurbosparkLogSumExp] runs on the CPU only");
}

void LogSumExp::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  enqueue(stream(), inputs, out, [](std::vector<mx::array>& in, mx::array& out) {
    const auto& x = in[0];
    const int M = x.shape(-1);
    const int L = M == 0 ? 0 : int(x.size() / M);
    const int64_t s1 = x.strides().back();
    const float* xp = x.data<float>();
    float* op = out.data<float>();
    const Isa& isa = active_isa();
    auto row = [&](int r) {
      const float* p = xp + row_offset(x, r);
      constexpr float kLeast = -std::numeric_limits<float>::infinity();
      float m[4] = {kLeast, kLeast, kLeast, kLeast};  // the maximum is exact in any order
      int i = 0;
      for (; i + 4 <= M; i += 4)
        for (int j = 0; j < 4; ++j) m[j] = std::max(m[j], p[(i + j) * s1]);
      for (; i < M; ++i) m[0] = std::max(m[0], p[i * s1]);
      const float maximum = std::max(std::max(m[0], m[1]), std::max(m[2], m[3]));
      if (std::isinf(maximum)) {
        op[r] = maximum;
        return;
      }
      constexpr int kChunk = 512;
      float e[kChunk];
      float normalizer = 0;
      for (int i0 = 0; i0 < M; i0 += kChunk) {
        const int n = std::min(kChunk, M - i0);
        for (int j = 0; j < n; ++j) e[j] = p[(i0 + j) * s1] - maximum;
        isa.exps(e, n);
        for (int j = 0; j < n; ++j) normalizer += e[j];  // in order, as MLX adds them
      }
      op[r] = std::log(normalizer) + maximum;
    };
    auto& team = pool();
    const int parts = std::min(L, team.size());
    if (parts <= 1 || size_t(L) * M < kParallelWork) {
      for (int r = 0; r < L; ++r) row(r);
    } else {
      team.run(row, L, parts);
    }
  });
}

// ------------------------------------------------------------------------------------ Split heads

std::vector<mx::array> split_heads(const mx::array& qkv, int hq, int hkv, mx::StreamOrDevice s_) {
  auto s = mx::to_stream(s_);
  check_cpu(s, "[split_heads]");
  if (qkv.ndim() != 3 || hq <= 0 || hkv <= 0 || qkv.shape(2) % (hq + 2 * hkv) != 0)
    throw std::invalid_argument("[split_heads] qkv must be (B, L, (Hq + 2 * Hkv) * D)");
  auto prim = std::make_shared<SplitHeads>(s, hq, hkv);
  auto shapes = prim->output_shapes({qkv});
  // the views need a row-contiguous buffer: a product's output is one
  const bool row_contiguous = qkv.is_available() ? bool(qkv.flags().row_contiguous)
                                                 : qkv.has_primitive() && dynamic_cast<RowsMatmul*>(&qkv.primitive());
  auto in = row_contiguous ? qkv : mx::contiguous(qkv, false, s);
  return mx::array::make_arrays(std::move(shapes), {qkv.dtype(), qkv.dtype(), qkv.dtype()}, prim, {in});
}

std::vector<mx::Shape> SplitHeads::output_shapes(const std::vector<mx::array>& inputs) {
  auto& x = inputs[0];
  const int B = x.shape(0), L = x.shape(1), D = x.shape(2) / (hq_ + 2 * hkv_);
  return {mx::Shape{B, hq_, L, D}, mx::Shape{B, hkv_, L, D}, mx::Shape{B, hkv_, L, D}};
}

bool SplitHeads::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const SplitHeads&>(other);
  return hq_ == o.hq_ && hkv_ == o.hkv_;
}

void SplitHeads::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[TurbosparkSplitHeads] runs on the CPU only");
}

void SplitHeads::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const int64_t L = x.shape(1), N = x.shape(2), D = N / (hq_ + 2 * hkv_);
  if (!x.flags().row_contiguous) throw std::runtime_error("[split_heads] qkv is not row-contiguous");
  for (int i = 0; i < 3; ++i) {
    auto& out = outputs[i];
    const int64_t first = i == 0 ? 0 : i == 1 ? hq_ : hq_ + hkv_;
    mx::Strides strides{L * N, D, N, 1};
    size_t span = 1;
    for (int d = 0; d < 4; ++d) span += size_t(out.shape(d) - 1) * strides[d];
    auto [no_broadcast, row, col] = mx::check_contiguity(out.shape(), strides);
    auto flags = x.flags();
    flags.row_contiguous = row;
    flags.col_contiguous = col;
    flags.contiguous = no_broadcast == span;
    out.copy_shared_buffer(x, strides, flags, span, first * D);
  }
}

// -------------------------------------------------------------------------------------- KV write

std::vector<mx::array> kv_write(const mx::array& keys, const mx::array& values, const mx::array& k,
                                const mx::array& v, int at, mx::StreamOrDevice s_) {
  auto s = mx::to_stream(s_);
  check_cpu(s, "[kv_write]");
  if (keys.ndim() != 4 || values.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    throw std::invalid_argument("[kv_write] keys, values, k and v must be (B, H, L, D)");
  const int L = k.shape(2);
  if (at < 0 || at + L > keys.shape(2) || keys.shape(2) != values.shape(2) || v.shape(2) != L)
    throw std::invalid_argument("[kv_write] the new rows do not fit in the cache");
  // float32 rows go into a float16 cache rounded as astype rounds them (a half-precision cache),
  // and into a cache in blocks of 32 quantized (kv_format)
  auto size = [](const mx::array& x, const mx::array& cache) {
    const int fmt = kv_format(cache.dtype());
    return fmt && x.dtype() == mx::float32 ? (x.shape(3) % 32 ? -1 : x.shape(3) / 32 * kv_block_bytes(fmt)) : x.shape(3);
  };
  for (int d : {0, 1}) {
    if (k.shape(d) != keys.shape(d) || v.shape(d) != values.shape(d))
      throw std::invalid_argument("[kv_write] k and v must match the cache's batch, heads and head size");
  }
  if (size(k, keys) != keys.shape(3) || size(v, values) != values.shape(3))
    throw std::invalid_argument("[kv_write] k and v must match the cache's batch, heads and head size");
  auto fits = [](const mx::array& x, const mx::array& cache) {
    return x.dtype() == cache.dtype() ||
           (x.dtype() == mx::float32 && (cache.dtype() == mx::float16 || kv_format(cache.dtype())));
  };
  if (!fits(k, keys) || !fits(v, values))
    throw std::invalid_argument("[kv_write] k and v must have the cache's types (or float32 for a float16 cache "
                                "or one in blocks)");
  std::vector<mx::array> out;
  for (auto [cache, x] : {std::pair{keys, k}, std::pair{values, v}})
    out.push_back(mx::array(cache.shape(), cache.dtype(), std::make_shared<KvWrite>(s, at), {cache, x}));
  for (int i = 0; i < 2; ++i) {
    auto stop = out[i].shape();
    stop[2] = at + L;
    out.push_back(mx::slice(out[i], mx::Shape{0, 0, 0, 0}, stop, s));
  }
  return out;
}

namespace {

// A row of n float32 values (st apart) as blocks of 32: llama.cpp's quantize_row_q8_0_ref (fmt 1)
// or quantize_row_q4_0_ref (fmt 2), the same bits.
void quantize_blocks(int fmt, const float* x, int64_t st, int n, uint8_t* out) {
  for (int b0 = 0; b0 < n; b0 += 32, out += kv_block_bytes(fmt)) {
    float v[32];
    for (int j = 0; j < 32; ++j) v[j] = x[(b0 + j) * st];
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 32; ++j) {
      if (amax < std::fabs(v[j])) {
        amax = std::fabs(v[j]);
        max = v[j];
      }
    }
    const float d = fmt == 1 ? amax / 127.0f : max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const float16_t dh = static_cast<float16_t>(d);
    std::memcpy(out, &dh, 2);
    if (fmt == 1) {
      for (int j = 0; j < 32; ++j) out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::roundf(v[j] * id)));
    } else {
      for (int j = 0; j < 16; ++j) {
        const int lo = std::min(15, int(static_cast<int8_t>(v[j] * id + 8.5f)));
        const int hi = std::min(15, int(static_cast<int8_t>(v[j + 16] * id + 8.5f)));
        out[2 + j] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
}

} // namespace

bool KvWrite::is_equivalent(const mx::Primitive& other) const {
  return at_ == static_cast<const KvWrite&>(other).at_;
}

void KvWrite::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[TurbosparkKvWrite] runs on the CPU only");
}

void KvWrite::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& cache = inputs[0];
  // in place where nothing else holds the cache's buffer (MLX's slice update does the same)
  const bool whole = !(cache.is_donatable() && cache.flags().row_contiguous);
  if (!whole) out.copy_shared_buffer(cache);
  enqueue(stream(), inputs, out, [at = at_, whole](std::vector<mx::array>& in, mx::array& out) {
    const auto &cache = in[0], &x = in[1];
    const size_t item = out.itemsize();
    const int B = out.shape(0), H = out.shape(1), C = out.shape(2), D = out.shape(3), L = x.shape(2);
    char* dst = out.data<char>();
    if (whole) {  // not donated: the cache's rows first, then the new ones
      if (cache.flags().row_contiguous) {
        std::memcpy(dst, cache.data<char>(), out.nbytes());
      } else {
        View4 c = view4(cache);
        for (int b = 0; b < B; ++b)
          for (int h = 0; h < H; ++h)
            for (int t = 0; t < C; ++t)
              for (int d = 0; d < D; ++d)
                std::memcpy(dst + (((size_t(b) * H + h) * C + t) * D + d) * item,
                            c.data + (b * c.st[0] + h * c.st[1] + t * c.st[2] + d * c.st[3]) * int64_t(item), item);
      }
    }
    View4 xv = view4(x);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < L; ++t) {
          char* row = dst + ((size_t(b) * H + h) * C + at + t) * D * item;
          if (x.dtype() != out.dtype() && kv_format(out.dtype())) {  // float32 rows into blocks
            const float* src = reinterpret_cast<const float*>(xv.data) + b * xv.st[0] + h * xv.st[1] + t * xv.st[2];
            quantize_blocks(kv_format(out.dtype()), src, xv.st[3], x.shape(3), reinterpret_cast<uint8_t*>(row));
            continue;
          }
          if (x.dtype() != out.dtype()) {  // float32 rows into a float16 cache
            const float* src = reinterpret_cast<const float*>(xv.data) + b * xv.st[0] + h * xv.st[1] + t * xv.st[2];
            float16_t* dst16 = reinterpret_cast<float16_t*>(row);
            for (int d = 0; d < D; ++d) dst16[d] = static_cast<float16_t>(src[d * xv.st[3]]);
            continue;
          }
          const char* src = xv.data + (b * xv.st[0] + h * xv.st[1] + t * xv.st[2]) * int64_t(item);
          if (xv.st[3] == 1) {
            std::memcpy(row, src, D * item);
          } else {
            for (int d = 0; d < D; ++d) std::memcpy(row + d * item, src + d * xv.st[3] * int64_t(item), item);
          }
        }
  });
}

} // namespace turbospark::kernels

// Matrix times a few rows: y[r][o] = sum_k x[r][k] * W[o][k], W in float32, bfloat16, float16 or
// MLX's affine 4- and 8-bit layout (w = scale * q + bias per group along k).
//
// One source, compiled once per instruction set (rows_kernels_*.cpp set ROWS_ISA and the flags):
// GCC's vector extensions become AVX2/FMA instructions with -mavx2 -mfma -mf16c, SSE2 on a plain
// x86-64 and NEON on aarch64.  Each weight row is read from memory once per call: a block of four
// output rows is kept in L1 (dequantized into a small tile first when more than two rows of x
// read it) while every row of x passes over it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace turbospark::kernels {

enum class WeightType : int { F32 = 0, BF16 = 1, F16 = 2, Affine4 = 3, Affine8 = 4 };
enum class ScaleType : int { F32 = 0, BF16 = 1, F16 = 2 };

// What one call computes: output rows [o0, o1) of y (R x N, float32) from x (R x K, float32).
struct RowsJob {
  const float* x;
  int R;
  int K;
  int N;
  WeightType wtype;
  const void* w;        // N x K (float types) or N x K*bits/32 uint32 words (affine)
  const void* scales;   // N x K/group (affine only)
  const void* biases;   // N x K/group (affine only)
  ScaleType stype;
  int group;            // 32, 64 or 128 (affine only)
  float* y;
  // affine weights times 8-bit activations (Isa::rows_q8): x as Isa::quantize wrote it
  const int8_t* x8 = nullptr;
  const float* d8 = nullptr;
  const float* xsg = nullptr;  // R x K/group: each group's sum of x as rounded (each 32's scale x sum(x8))
  const float* usg = nullptr;  // R x K/group, 8-bit weights: each group's 128 * d * sum(x8)
  const int32_t* xs8 = nullptr;  // R x K/32, packed 8-bit weights: each 32's sum of x8 (quantize_packed)
  int super_block = 0;  // 256 for Q5_K packed (rows_k5p: job.scales the chunks' K4Fields), else 0
};

using RowsFn = void (*)(const RowsJob& job, int o0, int o1);

// The kernels of one instruction set: the products, and the two loops of attention.
struct Isa {
  const char* name;
  RowsFn rows;
  // For G query heads that share their keys and values (grouped-query attention), each key and
  // value row read once for all G:
  // out[g * ost + j] = sum_e q[g * qst + e] * k[j * kst + e], for n rows of k
  void (*dots)(const float* q, int G, int64_t qst, const float* k, int64_t kst, int n, int d, float* out, int64_t ost);
  // acc[g * ast + e] += sum_j p[g * pst + j] * v[j * vst + e], for n rows of v (p = 0 skipped)
  void (*axpys)(const float* p, int G, int64_t pst, const float* v, int64_t vst, int n, int d, float* acc, int64_t ast);
  // the same two for keys and values held as float16 (a half-precision KV cache), widened
  // exactly as they are read: the same bits as dots and axpys on their float32 values
  void (*dots_h)(const float* q, int G, int64_t qst, const uint16_t* k, int64_t kst, int n, int d, float* out,
                 int64_t ost);
  void (*axpys_h)(const float* p, int G, int64_t pst, const uint16_t* v, int64_t vst, int n, int d, float* acc,
                  int64_t ast);
  // x[i] = exp(x[i]) in place, as MLX's CPU backend computes exp (the same bits)
  void (*exps)(float* x, int n);
  // out[i] = silu(gate[i]) * up[i] for float32, as rows.cpp's swiglu epilogue computes it for
  // any type (MLX's sigmoid: exp of -|g|, 1 / (1 + e), mirrored for g >= 0), the same bits;
  // scratch holds n floats
  void (*swiglu)(const float* gate, const float* up, float* out, float* scratch, int n);
  // out[i] = gelu(y[i]) for float32, nn.gelu's exact GELU as rows.cpp's gelu epilogue computes it
  // (erf by Abramowitz and Stegun 7.1.26 over exps); scratch holds n floats
  void (*gelus)(const float* y, float* out, float* scratch, int n);
  // weight rows [o0, o1) as float32, (o1 - o0) x K into out (for a GEMM of many rows of x)
  void (*widen)(const RowsJob& job, int o0, int o1, float* out);
  // Affine 4- and 8-bit weights times rows of x rounded to 8 bits per 32 values (as llama.cpp's
  // Q8_0 dot products do), for K a multiple of 64; nullptr where the set has no integer dot
  // products.  `quantize` writes, once a call, x8 (R x K; for 4-bit weights (`pairs`), each 64
  // values as their 32 even then 32 odd ones), d8 (R x K/8: each 32 values' scale, four times, in
  // the order of the kernel that reads them),
  // xsg and, for 8-bit weights, usg (R x K/G, RowsJob).
  RowsFn rows_q8;
  void (*quantize)(const float* x, int R, int K, int G, bool pairs, int8_t* x8, float* d8, float* xsg, float* usg);
  // 4- and 8-bit weights packed by pack_q times x rounded as `quantize` rounds it, written by
  // `quantize_packed`: x8 (R x K; for 4-bit weights (`pairs`) each 8 values as their 4 even then
  // 4 odd ones), d8 (R x K/32: each 32 values' scale), xsg and for 8-bit weights xs8; output rows
  // [o0, o1) in whole chunks of 8.  nullptr where the set cannot (then packed weights are read
  // unpacked: rows.cpp).
  RowsFn rows_q4p;
  RowsFn rows_q8p;
  void (*quantize_packed)(const float* x, int R, int K, int G, bool pairs, int8_t* x8, float* d8, float* xsg,
                          int32_t* xs8);
  // Q4_K super-blocks packed by pack_k4 (job.w the nibbles as rows_q4p reads them, job.scales
  // the chunks' K4Fields) times x as quantize_packed rounds it with groups of 32; nullptr where
  // the set cannot (then rows.cpp dequantizes them).
  RowsFn rows_k4p = nullptr;
  // Q6_K super-blocks packed by pack_k6 (job.w the low nibbles, job.biases the high bits,
  // job.scales the chunks' K6Fields, job.xs8 each 16's sum of x8); nullptr where the set cannot.
  RowsFn rows_k6p = nullptr;
  // Q5_0 and Q5_1 blocks packed by pack_k5 (job.w the low nibbles, job.biases the fifth bits,
  // job.scales the chunks' K5Fields), or with job.super_block 256 Q5_K super-blocks packed by
  // pack_k5k (the same nibbles and fifth bits, job.scales the chunks' K4Fields); nullptr where
  // the set cannot.
  RowsFn rows_k5p = nullptr;
  // dots and axpys for keys and values held in blocks of 32 (a quantized KV cache, kv_write):
  // fmt 1 llama.cpp's q8_0 (a float16 scale, 32 int8: 34 bytes), fmt 2 its q4_0 (a float16
  // scale, 16 bytes of nibbles: 18 bytes); rows kst (vst) bytes apart, d a multiple of 32, at
  // most kMaxBlockedHead
  void (*dots_b)(int fmt, const float* q, int G, int64_t qst, const uint8_t* k, int64_t kst, int n, int d, float* out,
                 int64_t ost) = nullptr;
  void (*axpys_b)(int fmt, const float* p, int G, int64_t pst, const uint8_t* v, int64_t vst, int n, int d,
                  float* acc, int64_t ast) = nullptr;
};

// The widest head a quantized KV cache holds.
constexpr int kMaxBlockedHead = 512;

// A Q5_0 or Q5_1 block's fields for the eight rows of a packed chunk (pack_k5): each row's d
// and m (float16; Q5_0's m is -16 d).  Value = d * q + m, q in 0..31.  With the nibbles and
// the fifth bits, 6 bits a weight (GGUF: Q5_0 5.5, Q5_1 6).
struct K5Fields {
  uint16_t d[8];
  uint16_t m[8];
};
static_assert(sizeof(K5Fields) == 32, "a chunk's block fields are 32 bytes");

// A Q6_K super-block's fields for the eight rows of a packed chunk (pack_k6): each row's d
// (float16) and its sixteen 16s' int8 scales ([16][row]).  Value = d * sc * (q - 32), q in
// 0..63.  With the nibbles and the high bits, 6.5625 bits a weight: GGUF's own.
struct K6Fields {
  uint16_t d[8];
  int8_t sc[16][8];
};
static_assert(sizeof(K6Fields) == 144, "a chunk's super-block fields are 144 bytes");

// A Q4_K super-block's fields for the eight rows of a packed chunk (pack_k4): each row's d and
// dmin (float16) and its eight 32s' 6-bit scales and minimums, unpacked to bytes ([32][row]).
// Value = d * sc * q - dmin * m, q the nibble.  4.625 bits a weight with the nibbles (GGUF: 4.5).
struct K4Fields {
  uint16_t d[8];
  uint16_t dmin[8];
  uint8_t sc[8][8];
  uint8_t m[8][8];
};
static_assert(sizeof(K4Fields) == 160, "a chunk's super-block fields are 160 bytes");

// MLX's affine 4- or 8-bit layout packed eight output rows together into the *_out buffers (the
// same sizes), for rows_q4p and rows_q8p (N a multiple of 8, K of 32; S the bytes of a scale):
// chunk c (rows 8c .. 8c + 7) keeps its span of bytes, now per 32 weights b and dword u of their
// `bits` dwords, the eight rows' dword u side by side (32 bytes), and its scales and biases as
// [group][row].  With to_packed false, packed weights are written back out in MLX's layout.
void pack_q(const uint8_t* w, const uint8_t* scales, const uint8_t* biases, int S, int N, int K, int G, int bits,
            bool to_packed, uint8_t* w_out, uint8_t* scales_out, uint8_t* biases_out);

const Isa& isa_portable();
// The set the kernels use now (rows.cpp: the best this CPU runs, or the one a test chose).
const Isa& active_isa();
#if defined(__x86_64__) || defined(_M_X64)
const Isa& isa_avx2();
// AVX2's set with another set's 8-bit products (rows_q8, rows_q4p, rows_q8p, rows_k4p, rows_k6p,
// rows_k5p) under another name
Isa avx2_with_rows_q8(const char* name, RowsFn rows_q8, RowsFn rows_q4p, RowsFn rows_q8p, RowsFn rows_k4p,
                      RowsFn rows_k6p, RowsFn rows_k5p);
// AVX2's set with AVX-VNNI's 8-bit products, and whether this CPU really runs AVX-VNNI
const Isa& isa_vnni();
bool vnni_runs();
// the same with AVX-512 VNNI's 256-bit instruction, for CPUs that have it without AVX-VNNI
const Isa& isa_avx512vnni();
bool avx512vnni_runs();
#endif
// fn() returns here without raising SIGILL (rows.cpp)
bool runs_without_sigill(void (*fn)());

} // namespace turbospark::kernels

// y = x @ W^T (+ bias) for a few float32 rows x, with W read straight from its GGUF blocks (Q4_0, Q4_1, Q8_0).
//
// On a CPU without native bf16 (AVX2, or AVX-512 without AVX512-BF16) eyas runs float32, and a decode step of a
// small model is bound by streaming its weights: SmolLM2-135M reads 540 MB of float32 a token, its GGUF file holds
// the same weights in 98 MB. This kernel reads the blocks, rebuilds each weight as the float32 value eyas's loader
// produced from the same file (gguf-py's formula, gguf_quants.h; eyas.models.gguf_blocks checks every row at load),
// and multiplies it in L1 against every input row.
//
// Numerics are skinny_gemm.cpp's, bit for bit: output (m, n) is the dot product of x[m] and W[n] accumulated in
// 8 float32 lanes with fused multiply-add (lane l takes k = l, l + 8, ...), reduced by the fixed tree (l, l+4),
// (l, l+2), (l, l+1), then the bias added. So a projection gives the same bits from its blocks as from its dense
// float32 weight on the streaming kernel (the path it replaces), and a row gets the same bits alone (plain
// decoding) or among a tree's nodes (verification): the kernel is row-invariant.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "f32_dot.h"  // the summation order, skinny_gemm.cpp's (block, reduce8)
#include "gguf_quants.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EYAS_GGUF_F32 1
#endif

namespace {

using namespace eyas_gguf;
using namespace eyas_f32;

constexpr int64_t NB = 4;         // weight rows per group, dequantised into L1 once for every input row
constexpr int64_t MAX_ROWS = 32;  // skinny_gemm.cpp's: past that the dense GEMM serves

#ifdef EYAS_GGUF_F32
inline __m256 half8(const uint8_t* p) {  // one fp16 broadcast to 8 lanes (hardware conversion)
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_set1_ps(_cvtsh_ss(h));
}

// 8 weights from 8 small integers (int8 lanes of q, low 8 bytes): d * q, or d * q + m (multiply, then add)
template <bool SIGNED, bool MIN>
inline __m256 scale8(__m128i q, __m256 d, __m256 m) {
  const __m256i qi = SIGNED ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
  const __m256 w = _mm256_mul_ps(d, _mm256_cvtepi32_ps(qi));
  return MIN ? _mm256_add_ps(w, m) : w;
}

// one block -> 32 float32 weights at out, gguf-py's values (gguf_quants.h: dequant_block_f32)
inline void dequant_block(const uint8_t* blk, int64_t qtype, float* out) {
  const __m256 d = half8(blk);
  if (qtype == Q8_0) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    _mm256_storeu_ps(out, scale8<true, false>(a, d, d));
    _mm256_storeu_ps(out + 8, scale8<true, false>(_mm_srli_si128(a, 8), d, d));
    _mm256_storeu_ps(out + 16, scale8<true, false>(b, d, d));
    _mm256_storeu_ps(out + 24, scale8<true, false>(_mm_srli_si128(b, 8), d, d));
    return;
  }
  const bool q41 = qtype == Q4_1;
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (q41 ? 4 : 2)));
  const __m128i nib = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
  if (q41) {
    const __m256 m = half8(blk + 2);
    _mm256_storeu_ps(out, scale8<false, true>(lo, d, m));
    _mm256_storeu_ps(out + 8, scale8<false, true>(_mm_srli_si128(lo, 8), d, m));
    _mm256_storeu_ps(out + 16, scale8<false, true>(hi, d, m));
    _mm256_storeu_ps(out + 24, scale8<false, true>(_mm_srli_si128(hi, 8), d, m));
    return;
  }
  const __m128i eight = _mm_set1_epi8(8);  // Q4_0: q - 8 as int8, then d * (q - 8)
  lo = _mm_sub_epi8(lo, eight);
  hi = _mm_sub_epi8(hi, eight);
  _mm256_storeu_ps(out, scale8<true, false>(lo, d, d));
  _mm256_storeu_ps(out + 8, scale8<true, false>(_mm_srli_si128(lo, 8), d, d));
  _mm256_storeu_ps(out + 16, scale8<true, false>(hi, d, d));
  _mm256_storeu_ps(out + 24, scale8<true, false>(_mm_srli_si128(hi, 8), d, d));
}

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
// AVX-512: two weight rows share a register, each in its own 8-lane half, so every accumulator lane still takes
// k = l, l + 8, ... of one row: twice the multiply-adds an instruction, skinny_gemm.cpp's sums unchanged. The group's
// 4 rows are dequantised as pairs: pair buffer chunk c (16 floats) = row 2p's k in [8c, 8c + 8), then row 2p + 1's.
// A Q4_* block's 16 possible weights are computed once (d * q (+ m) for q = 0..15) and the nibbles pick from that
// table (VPERMPS), as gguf_bf16.cpp does in bf16.

inline void store_pair_half(float* pair, int64_t chunk, int half, __m512 v) {  // v = 16 weights = chunks c, c + 1
  float* dst = pair + 16 * chunk + 8 * half;
  _mm256_storeu_ps(dst, _mm512_castps512_ps256(v));
  _mm512_mask_storeu_ps(dst + 16 - 8, 0xFF00, v);  // lanes 8..15 to the next chunk's half, no shuffle
}

inline void dequant_block16(const uint8_t* blk, int64_t qtype, __m512& lo, __m512& hi) {
  uint16_t h;
  std::memcpy(&h, blk, 2);
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(h));
  if (qtype == Q8_0) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
    return;
  }
  __m512 table;
  if (qtype == Q4_1) {
    std::memcpy(&h, blk + 2, 2);
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    table = _mm512_add_ps(_mm512_mul_ps(d, q), _mm512_set1_ps(_cvtsh_ss(h)));  // multiply, then add
  } else {
    const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    table = _mm512_mul_ps(d, q);
  }
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (qtype == Q4_1 ? 4 : 2))));
  lo = _mm512_permutexvar_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)), table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

// Input rows per pass over a group's dequantised pairs: 8 takes 2 * 8 accumulators + 2 weights + 1 input of the 32
// registers, so a verify tree of 5-8 nodes multiplies in one pass (1.6-2 ms a forward less than two passes of 4 over
// SmolLM2-135M's blocks, Ice Lake VM); a row's sums do not depend on it (-DEYAS_F32_MR_MAX=4 builds the old kernel).
#ifndef EYAS_F32_MR_MAX
#define EYAS_F32_MR_MAX 8
#endif
constexpr int MR_MAX = EYAS_F32_MR_MAX;
static_assert(MR_MAX >= 1 && MR_MAX <= 8, "EYAS_F32_MR_MAX: 1 to 8 (group's switch)");

// rows x[0 .. MR) against the group's pairs (pairs[p], 2k floats each); out[i * ldo + j] for j < 4
template <int MR>
inline void micro(const float* const* x, const float* const* pairs, int64_t k, float* out, int64_t ldo) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k / 8; ++c) {
    const __m512 w0 = _mm512_loadu_ps(pairs[0] + 16 * c), w1 = _mm512_loadu_ps(pairs[1] + 16 * c);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x[i] + 8 * c));
      acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < 2; ++p) {
      out[i * ldo + 2 * p] = reduce8(_mm512_castps512_ps256(acc[i][p]));
      out[i * ldo + 2 * p + 1] = reduce8(_mm512_extractf32x8_ps(acc[i][p], 1));
    }
}

// m rows of x against the 4 weight rows whose blocks start at w[j] (a short group repeats its last row): out[i * 4 + j]
void group(const float* xd, int64_t m, const uint8_t* const* w, int64_t k, int64_t bb, int64_t qtype,
           std::vector<float>& buf, float* out) {
  buf.resize(static_cast<size_t>(4 * k));
  float* pairs[2] = {buf.data(), buf.data() + 2 * k};
  for (int j = 0; j < 4; ++j)
    for (int64_t b = 0; b < k / QK; ++b) {
      __m512 lo, hi;
      dequant_block16(w[j] + bb * b, qtype, lo, hi);
      store_pair_half(pairs[j / 2], 4 * b, j % 2, lo);
      store_pair_half(pairs[j / 2], 4 * b + 2, j % 2, hi);
    }
  const float* ps[2] = {pairs[0], pairs[1]};
  const float* xs[MR_MAX];
  for (int64_t i = 0; i < m;) {
    const int rows = static_cast<int>(std::min<int64_t>(m - i, MR_MAX));
    for (int r = 0; r < rows; ++r) xs[r] = xd + (i + r) * k;
    switch (rows) {
      case 8: micro<8>(xs, ps, k, out + i * 4, 4); break;
      case 7: micro<7>(xs, ps, k, out + i * 4, 4); break;
      case 6: micro<6>(xs, ps, k, out + i * 4, 4); break;
      case 5: micro<5>(xs, ps, k, out + i * 4, 4); break;
      case 4: micro<4>(xs, ps, k, out + i * 4, 4); break;
      case 3: micro<3>(xs, ps, k, out + i * 4, 4); break;
      case 2: micro<2>(xs, ps, k, out + i * 4, 4); break;
      default: micro<1>(xs, ps, k, out + i * 4, 4); break;
    }
    i += rows;
  }
}
#else
// m rows of x against the 4 weight rows whose blocks start at w[j] (a short group repeats its last row): dequantised
// into buf first (L1), then every row in register blocks of up to 2; out[i * 4 + j]
void group(const float* xd, int64_t m, const uint8_t* const* w, int64_t k, int64_t bb, int64_t qtype,
           std::vector<float>& buf, float* out) {
  buf.resize(static_cast<size_t>(4 * k));
  const float* ws[4];
  for (int j = 0; j < 4; ++j) {
    float* dst = buf.data() + j * k;
    for (int64_t b = 0; b < k / QK; ++b) dequant_block(w[j] + bb * b, qtype, dst + QK * b);
    ws[j] = dst;
  }
  const float* xs[2];
  for (int64_t i = 0; i < m;) {
    const int rows = static_cast<int>(std::min<int64_t>(m - i, 2));
    for (int r = 0; r < rows; ++r) xs[r] = xd + (i + r) * k;
    if (rows == 2) block<2, 4>(xs, ws, k, k, out + i * 4, 4);  // f32_dot.h: the streaming kernel's own sums
    else block<1, 4>(xs, ws, k, k, out + i * 4, 4);
    i += rows;
  }
}
#endif
#endif

// blocks [N, K / 32 * block_bytes] uint8 -> [N, K] float32: the weights the kernel multiplies with (load check)
torch::Tensor dequantize(torch::Tensor blocks, int64_t qtype, int64_t k) {
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && k % QK == 0 && blocks.size(1) == k / QK * bb,
              "gguf_f32.dequantize: blocks [N, K / 32 * ", bb, "] uint8 for K = ", k);
  blocks = blocks.contiguous();
  const int64_t n = blocks.size(0), nblk = k / QK;
  auto out = torch::empty({n, k}, blocks.options().dtype(at::kFloat));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n * nblk, 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
#ifdef EYAS_GGUF_F32
      dequant_block(src + b * bb, qtype, dst + b * QK);  // the kernel's own conversion, checked against the loader
#else
      dequant_block_f32(src + b * bb, qtype, dst + b * QK);
#endif
    }
  });
  return out;
}

// x [M, K] float32 (M <= MAX_ROWS), blocks [N, K / 32 * block_bytes] uint8, bias [N] or empty -> [M, N] float32
torch::Tensor linear(torch::Tensor x, torch::Tensor blocks, int64_t qtype, torch::Tensor bias) {
#ifdef EYAS_GGUF_F32
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "gguf_f32.linear: x [M, K] float32");
  TORCH_CHECK(x.size(0) <= MAX_ROWS, "gguf_f32.linear: at most ", MAX_ROWS, " rows");
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  const torch::Tensor b32 = checked_bias("gguf_f32.linear", x, blocks, qtype, bias);  // blocks and bias checked
  const float* bd = b32.defined() ? b32.data_ptr<float>() : nullptr;
  x = x.contiguous();
  auto out = torch::empty({m, n}, x.options());
  const float* xd = x.data_ptr<float>();
  const uint8_t* wd = blocks.data_ptr<uint8_t>();
  float* od = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1), groups = (n + NB - 1) / NB;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf;
    float acc[MAX_ROWS * NB];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t j0 = g * NB, nr = std::min<int64_t>(NB, n - j0);
      const uint8_t* ws[NB];
      for (int64_t j = 0; j < NB; ++j) ws[j] = wd + (j0 + std::min(j, nr - 1)) * row_bytes;
      group(xd, m, ws, k, bb, qtype, buf, acc);
      for (int64_t i = 0; i < m; ++i)  // the bias after the sum, in float32 (skinny_gemm.cpp adds it the same way)
        for (int64_t j = 0; j < nr; ++j) od[i * n + j0 + j] = bd ? acc[i * NB + j] + bd[j0 + j] : acc[i * NB + j];
    }
  });
  return out;
#else
  TORCH_CHECK(false, "gguf_f32.linear: built without AVX2, FMA and F16C");
#endif
}

bool available() {
#ifdef EYAS_GGUF_F32
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ W.T + bias, float32 rows x, W as GGUF Q4_0/Q4_1/Q8_0 blocks (AVX2, FMA)");
  m.def("dequantize", &dequantize, "GGUF blocks -> the float32 weights the kernel multiplies with");
  m.def("available", &available, "whether linear was built (AVX2, FMA and F16C at compile time)");
  m.def("block_bytes", &block_bytes, "bytes per 32-weight block of a GGML type");
  m.def("max_rows", [] { return MAX_ROWS; }, "the most rows linear accepts");
}

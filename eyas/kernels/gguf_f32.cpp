// y = x @ W^T (+ bias) for a few float32 rows x, with W read straight from its GGUF blocks (Q4_0, Q4_1, Q8_0).
//
// On a CPU without native bf16 (AVX2, or AVX-512 without AVX512-BF16) eyas runs float32, and a decode step of a
// small model is bound by streaming its weights: SmolLM2-135M reads 540 MB of float32 a token, its GGUF file holds
// the same weights in 98 MB. This kernel reads the blocks, rebuilds each weight as the float32 value eyas's loader
// produced from the same file (gguf-py's formula, gguf_quants.h; eyas.models.gguf_blocks checks every row at load),
// and multiplies it against every input row in registers as each block is rebuilt (AVX-512 up to 16 rows, AVX2 up to
// 8; past that from an L1 buffer of the group's rebuilt weights). With AVX-512 it takes any number of rows,
// so exact mode's prefill reads the blocks too (past 16 rows 8 weight rows at a time, K in L1-sized slices: ~140
// GMAC/s on the 2-core Ice Lake VM, where MKL's float32 GEMM needs 68-91 ms for SmolLM2's projections at 17-64
// rows against 19-51 ms here, 1.04x MKL's speed at 128 rows, 0.90x at 256).
//
// Numerics are skinny_gemm.cpp's, bit for bit: output (m, n) is the dot product of x[m] and W[n] accumulated in
// 8 float32 lanes with fused multiply-add (lane l takes k = l, l + 8, ...), reduced by the fixed tree (l, l+4),
// (l, l+2), (l, l+1), then the bias added. So a projection gives the same bits from its blocks as from its dense
// float32 weight on the streaming kernel (the path it replaces), and a row gets the same bits alone (plain
// decoding) or among a tree's nodes (verification): the kernel is row-invariant.
#include "torch_ext.h"
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

constexpr int64_t NB = 4;         // weight rows per group: each block rebuilt once for every input row of a pass
constexpr int64_t MAX_ROWS = 32;  // without AVX-512 (skinny_gemm.cpp's): past that the dense GEMM serves

#ifdef EYAS_GGUF_F32
// the block's scale d, and Q4_1's minimum m, broadcast to 8 lanes (one VCVTPH2PS for both)
template <int64_t QT>
inline void scales8(const uint8_t* blk, __m256& d, __m256& m) {
  int32_t raw;
  std::memcpy(&raw, blk, 4);  // d (and m): every block type has at least 18 bytes
  const __m128 s = _mm_cvtph_ps(_mm_cvtsi32_si128(raw));
  d = _mm256_broadcastss_ps(s);
  if constexpr (QT == Q4_1) m = _mm256_broadcastss_ps(_mm_movehdup_ps(s));
}

// weights 8c .. 8c + 7 of a block as float32, gguf-py's values: d * q, or d * q + m as one fused multiply-add (d * q is
// exact in float32, so one rounding of the sum is what multiply-then-add gives). The chunk's quants are read from the
// block by one widening load (Q4 types: bytes 0-7 hold chunks 0 and 2, bytes 8-15 chunks 1 and 3, low nibble then
// high), not widened once a block and held in two registers: on Zen 3 the 121 projections ran 1.03-1.07x faster so at
// 1-6 rows and 1.17x at 8 (the registers freed serve the accumulators; scripts/f32_kernel_ab.py)
template <int64_t QT>
inline __m256 chunk8(const uint8_t* blk, int c, __m256 d, __m256 m) {
  if constexpr (QT == Q8_0) {
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * c));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h)));
  } else {
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + (QT == Q4_1 ? 4 : 2) + 8 * (c & 1)));
    const __m256i b = _mm256_cvtepu8_epi32(h);
    const __m256i v = c < 2 ? _mm256_and_si256(b, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(b, 4);
    if constexpr (QT == Q4_1) return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(v), m);
    else return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(8))));
  }
}

// one block -> 32 float32 weights at out, gguf-py's values (gguf_quants.h: dequant_block_f32): the register path's
// own rebuild, stored; so the load's check of dequantize() checks the weights every AVX2 path multiplies with
template <int64_t QT>
inline void dequant_block_of(const uint8_t* blk, float* out) {
  __m256 d, m = _mm256_setzero_ps();
  scales8<QT>(blk, d, m);
  for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + 8 * c, chunk8<QT>(blk, c, d, m));
}

inline void dequant_block(const uint8_t* blk, int64_t qtype, float* out) {
  switch (qtype) {
    case Q8_0: dequant_block_of<Q8_0>(blk, out); return;
    case Q4_1: dequant_block_of<Q4_1>(blk, out); return;
    default: dequant_block_of<Q4_0>(blk, out); return;
  }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
// AVX-512: two weight rows share a register, each in its own 8-lane half, so every accumulator lane still takes
// k = l, l + 8, ... of one row: twice the multiply-adds an instruction, skinny_gemm.cpp's sums unchanged.
//
// Each 32-weight block of the group's 4 rows is rebuilt in registers and multiplied at once: no pass through an L1
// buffer. The former kernel wrote every rebuilt weight to a buffer and read it back per input row; its stores, the
// lookups of a 16-entry table (VPERMPS) and the scale broadcasts all queued on one port, and a token's projections
// ran at ~40 cycles per 4 x 32 weights on the Ice Lake VM (5-7 GB/s of blocks on 2 cores against ~20 GB/s the
// memory gives); here the integer-to-float conversions and multiply-adds spread over two ports
// (scripts/f32_kernel_ab.py times both).

// 32 weights of one block: k 0..15 in lo, 16..31 in hi, gguf-py's values (gguf_quants.h: dequant_block_f32). The
// fp16 scale (and minimum) are converted by one VCVTPH2PS, then broadcast (the compiler keeps them in registers;
// forcing the broadcasts through memory measured slower, as did converting a pass's scales up front). Q4_1's
// d * q + m is one fused multiply-add: d * q is exact in float32 (11 significant bits times at most 4), so rounding
// d * q + m once is rounding the sum of the exact product, as multiply-then-add does.
template <int64_t QT>
inline void dequant_block16(const uint8_t* blk, __m512& lo, __m512& hi) {
  alignas(16) float dm[4];
  _mm_store_ps(dm, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk))));  // d, m (Q4_1), ...
  const __m512 d = _mm512_set1_ps(dm[0]);
  if constexpr (QT == Q8_0) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
  } else {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == Q4_1 ? 4 : 2))));
    const __m512i ql = _mm512_and_si512(q, _mm512_set1_epi32(0x0F)), qh = _mm512_srli_epi32(q, 4);
    if constexpr (QT == Q4_1) {
      const __m512 m = _mm512_set1_ps(dm[1]);
      lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(ql), m);
      hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(qh), m);
    } else {  // Q4_0: d * (q - 8)
      const __m512i eight = _mm512_set1_epi32(8);
      lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ql, eight)));
      hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(qh, eight)));
    }
  }
}

// Input rows per pass over a group's weights: 8 keep 8 rebuilt weights + 2 pairs + 16 accumulators + 1 input in the 32
// registers. A row's sums do not depend on it.
constexpr int MR_MAX = 8;

template <int MR>
__attribute__((always_inline)) inline void reduce_out(__m512 (&acc)[MR][2], float* out) {  // out[i * 4 + j]
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < 2; ++p) {
      out[i * 4 + 2 * p] = reduce8(_mm512_castps512_ps256(acc[i][p]));
      out[i * 4 + 2 * p + 1] = reduce8(_mm512_extractf32x8_ps(acc[i][p], 1));
    }
}

// rows x[0 .. MR) (row stride k) against the 4 weight rows whose blocks start at w[j], each block rebuilt in registers
// noinline: inlined into linear's loop (all 8 row counts of 3 types in one function) the accumulators spilled to the
// stack inside the hot loop (8 rows at half speed)
template <int MR, int64_t QT>
__attribute__((noinline)) void direct_pass(const float* x, const uint8_t* const* w, int64_t k, float* out) {
  constexpr int64_t bb = block_bytes(QT);
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / QK; ++b) {
    __m512 lo[4], hi[4];
    for (int j = 0; j < 4; ++j) dequant_block16<QT>(w[j] + bb * b, lo[j], hi[j]);
    for (int c = 0; c < 4; ++c) {  // k chunk 8c .. 8c + 7 of the block: pair p = [row 2p's 8 | row 2p + 1's 8]
      const __m512* src = c < 2 ? lo : hi;
      const __m512 w0 = (c & 1) ? _mm512_shuffle_f32x4(src[0], src[1], 0xEE) : _mm512_shuffle_f32x4(src[0], src[1], 0x44);
      const __m512 w1 = (c & 1) ? _mm512_shuffle_f32x4(src[2], src[3], 0xEE) : _mm512_shuffle_f32x4(src[2], src[3], 0x44);
      for (int i = 0; i < MR; ++i) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i * k + QK * b + 8 * c));
        acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
      }
    }
  }
  reduce_out<MR>(acc, out);
}

// Past DIRECT_ROWS input rows, rebuilding the blocks once per pass of 8 costs more than rebuilding them once into an
// L1 buffer every pass reads (Ice Lake VM, all passes rebuilding: 32 rows 0.91x the buffer's speed, 16 the same, 9
// 1.05x): there gguf_f32_wide.h's path serves.
constexpr int64_t DIRECT_ROWS = 16;

// m <= DIRECT_ROWS rows of x against the 4 weight rows whose blocks start at w[j] (a short group repeats its last
// row): out[i * 4 + j]
template <int64_t QT>
void group_of(const float* xd, int64_t m, const uint8_t* const* w, int64_t k, float* out) {
  for (int64_t i = 0; i < m;) {
    const int rows = static_cast<int>(std::min<int64_t>(m - i, MR_MAX));
    const float* x = xd + i * k;
    float* o = out + i * 4;
    switch (rows) {
      case 8: direct_pass<8, QT>(x, w, k, o); break;
      case 7: direct_pass<7, QT>(x, w, k, o); break;
      case 6: direct_pass<6, QT>(x, w, k, o); break;
      case 5: direct_pass<5, QT>(x, w, k, o); break;
      case 4: direct_pass<4, QT>(x, w, k, o); break;
      case 3: direct_pass<3, QT>(x, w, k, o); break;
      case 2: direct_pass<2, QT>(x, w, k, o); break;
      default: direct_pass<1, QT>(x, w, k, o); break;
    }
    i += rows;
  }
}

#include "gguf_f32_wide.h"  // past DIRECT_ROWS: 8 weight rows a pass, K in slices (defines EYAS_GGUF_F32_WIDE)

void group(const float* xd, int64_t m, const uint8_t* const* w, int64_t k, int64_t, int64_t qtype,
           std::vector<float>&, float* out) {  // (no buffer: past DIRECT_ROWS linear takes the wide path)
  switch (qtype) {
    case Q8_0: group_of<Q8_0>(xd, m, w, k, out); break;
    case Q4_1: group_of<Q4_1>(xd, m, w, k, out); break;
    default: group_of<Q4_0>(xd, m, w, k, out); break;
  }
}
#else
// AVX2 (16 registers): up to DIRECT2_ROWS input rows, each 8-weight chunk of a block is rebuilt in a register and
// multiplied at once against every row (at most 8 accumulators a pass beside the chunk and the scales), so the
// rebuilt weights never go through memory. Past DIRECT2_ROWS the rebuilt group is kept in an L1 buffer every pass of 2
// rows reads. Every accumulator takes k = l, l + 8, ... of one weight row in order either way (f32_dot.h's sums, bit
// for bit). The rebuild (scales8, chunk8) is dequant_block's.

// Rows a call takes in registers (Zen 3, 2 cores, the embedded model's 121 projections, both with the prefetch below:
// 1 / 2 / 3 / 4 rows 1.42 / 1.45 / 1.5 / 1.17x the buffer's speed; 5-8 rows, one weight row a pass, 1.22-1.31x; past
// 8 rows, passes of 8 rebuilding the blocks again, 0.8-1.0x).
constexpr int64_t DIRECT2_ROWS = 8;

// Software prefetch, PREFETCH_GROUPS groups of 4 weight rows ahead of the block being read (a group's rows are
// contiguous, so this is the same block of a later group). A decode step streams ~96 MB of blocks through 2 cores;
// without it the hardware prefetcher left a 1-row projection of the embedded model at ~4.5 GB/s of the VM's ~18 GB/s
// (the 121 projections 14.8 -> 8.1 ms, Zen 3; 1 and 4 groups ahead measured the same as 2).
constexpr int64_t PREFETCH_GROUPS = 2;
inline int64_t prefetch_ahead(int64_t bb, int64_t k) { return PREFETCH_GROUPS * 4 * bb * (k / QK); }

// rows x[0 .. MR) (row stride k) against the NJ weight rows whose blocks start at w[j]; out[i * 4 + j]. MR * NJ <= 8
// accumulators. noinline, as the AVX-512 passes, so the accumulators stay in registers
template <int MR, int NJ, int64_t QT>
__attribute__((noinline)) void direct_pass(const float* x, const uint8_t* const* w, int64_t k, float* out) {
  constexpr int64_t bb = block_bytes(QT);
  const int64_t ahead = prefetch_ahead(bb, k);
  __m256 acc[MR][NJ];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NJ; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / QK; ++b) {
    const float* xb = x + QK * b;
    for (int j = 0; j < NJ; ++j) {
      const uint8_t* blk = w[j] + bb * b;
      _mm_prefetch(reinterpret_cast<const char*>(blk + ahead), _MM_HINT_T0);  // never faults past the end
      __m256 d, m = _mm256_setzero_ps();
      scales8<QT>(blk, d, m);
      for (int c = 0; c < 4; ++c) {
        const __m256 wv = chunk8<QT>(blk, c, d, m);
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + i * k + 8 * c), wv, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NJ; ++j) out[i * 4 + j] = reduce8(acc[i][j]);
}

template <int MR, int64_t QT>
void one_row_passes(const float* x, const uint8_t* const* w, int64_t k, float* out) {  // a pass per weight row
  for (int j = 0; j < 4; ++j) direct_pass<MR, 1, QT>(x, w + j, k, out + j);
}

// m <= DIRECT2_ROWS rows against the group's 4 weight rows, each block rebuilt once: 1-2 rows in one pass over all 4
// weight rows, 3-4 rows in two passes over 2, 5-8 rows in four passes over 1 (up to 8 accumulators a pass)
template <int64_t QT>
void direct_group(const float* x, int64_t m, const uint8_t* const* w, int64_t k, float* out) {
  switch (m) {
    case 8: one_row_passes<8, QT>(x, w, k, out); break;
    case 7: one_row_passes<7, QT>(x, w, k, out); break;
    case 6: one_row_passes<6, QT>(x, w, k, out); break;
    case 5: one_row_passes<5, QT>(x, w, k, out); break;
    case 4: direct_pass<4, 2, QT>(x, w, k, out); direct_pass<4, 2, QT>(x, w + 2, k, out + 2); break;
    case 3: direct_pass<3, 2, QT>(x, w, k, out); direct_pass<3, 2, QT>(x, w + 2, k, out + 2); break;
    case 2: direct_pass<2, 4, QT>(x, w, k, out); break;
    case 1: direct_pass<1, 4, QT>(x, w, k, out); break;
    default: break;  // no rows (an empty batch): nothing to read
  }
}

// m rows of x against the 4 weight rows whose blocks start at w[j] (a short group repeats its last row): out[i * 4 + j].
// Up to DIRECT2_ROWS rows in registers; past it dequantised into buf first (L1), then every row in register blocks
// of up to 2
void group(const float* xd, int64_t m, const uint8_t* const* w, int64_t k, int64_t bb, int64_t qtype,
           std::vector<float>& buf, float* out) {
  if (m <= DIRECT2_ROWS) {
    switch (qtype) {
      case Q8_0: direct_group<Q8_0>(xd, m, w, k, out); return;
      case Q4_1: direct_group<Q4_1>(xd, m, w, k, out); return;
      default: direct_group<Q4_0>(xd, m, w, k, out); return;
    }
  }
  buf.resize(static_cast<size_t>(4 * k));
  const float* ws[4];
  const int64_t ahead = prefetch_ahead(bb, k);
  for (int j = 0; j < 4; ++j) {
    float* dst = buf.data() + j * k;
    for (int64_t b = 0; b < k / QK; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w[j] + bb * b + ahead), _MM_HINT_T0);
      dequant_block(w[j] + bb * b, qtype, dst + QK * b);
    }
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
at::Tensor dequantize(at::Tensor blocks, int64_t qtype, int64_t k) {
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && k % QK == 0 && blocks.size(1) == k / QK * bb,
              "gguf_f32.dequantize: blocks [N, K / 32 * ", bb, "] uint8 for K = ", k);
  blocks = blocks.contiguous();
  const int64_t n = blocks.size(0), nblk = k / QK;
  auto out = at::empty({n, k}, blocks.options().dtype(at::kFloat));
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

// the most rows linear takes: any number where the many-row path is built (AVX-512), else MAX_ROWS
int64_t max_rows() {
#ifdef EYAS_GGUF_F32_WIDE
  return INT64_MAX;
#else
  return MAX_ROWS;
#endif
}

// x [M, K] float32 (M <= max_rows()), blocks [N, K / 32 * block_bytes] uint8, bias [N] or empty -> [M, N] float32
at::Tensor linear(at::Tensor x, at::Tensor blocks, int64_t qtype, at::Tensor bias) {
#ifdef EYAS_GGUF_F32
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "gguf_f32.linear: x [M, K] float32");
  TORCH_CHECK(x.size(0) <= max_rows(), "gguf_f32.linear: at most ", max_rows(), " rows");
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  const at::Tensor b32 = checked_bias("gguf_f32.linear", x, blocks, qtype, bias);  // blocks and bias checked
  const float* bd = b32.defined() ? b32.data_ptr<float>() : nullptr;
  x = x.contiguous();
  auto out = at::empty({m, n}, x.options());
  const float* xd = x.data_ptr<float>();
  const uint8_t* wd = blocks.data_ptr<uint8_t>();
  float* od = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1), groups = (n + NB - 1) / NB;
#ifdef EYAS_GGUF_F32_WIDE
  if (m > DIRECT_ROWS) {
    at::parallel_for(0, (n + WIDE_NB - 1) / WIDE_NB, 4, [&](int64_t g0, int64_t g1) {
      std::vector<float> buf, state, acc(static_cast<size_t>(m * WIDE_NB));
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t j0 = g * WIDE_NB, nr = std::min<int64_t>(WIDE_NB, n - j0);
        const uint8_t* ws[WIDE_NB];
        for (int64_t j = 0; j < WIDE_NB; ++j) ws[j] = wd + (j0 + std::min(j, nr - 1)) * row_bytes;
        wide_group(xd, m, ws, k, qtype, buf, state, acc.data());
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < nr; ++j)
            od[i * n + j0 + j] = bd ? acc[i * WIDE_NB + j] + bd[j0 + j] : acc[i * WIDE_NB + j];
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf;
    float acc[MAX_ROWS * NB];  // m <= MAX_ROWS here (DIRECT_ROWS with AVX-512)
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
  m.def("max_rows", &max_rows, "the most rows linear accepts (any number with AVX-512)");
}

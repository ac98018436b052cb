// y = x @ W^T (+ bias) for a few bf16 rows x, with W read straight from its GGUF blocks (Q4_0, Q4_1, Q8_0).
//
// A bf16 decode step of a small model is bound by reading the weights: SmolLM2-135M streams 269 MB of
// bf16 per token, its GGUF file holds the same weights in 98 MB. This kernel reads the blocks, turns each
// weight into the bf16 value eyas's loader produced from the same file (gguf-py's formula in float32,
// then round to nearest even), and multiplies with AVX512-BF16 (VDPBF16PS). So it computes with exactly
// the loaded bf16 weights, reading 2.7x fewer bytes; eyas.models.gguf_blocks checks every row at load.
//
// Dequantisation: gguf-py's float32 formula (gguf_quants.h, built with -ffp-contract=off). Q4 blocks are read in
// the kernel's own packed layout of the same bytes (pack(), dequant_packed); up to 4 rows then multiply each block
// in registers as it is dequantised (rows_packed), more rows through an L1 buffer of the group's weights.
//
// Numerics: output (m, n) accumulates in 16 float32 lanes, lane l taking the products of weights
// 2l and 2l + 1 of every 32-weight block, blocks in order (VDPBF16PS: bf16 products are exact in
// float32); the lanes are summed by a fixed tree, then the bias is added and the sum rounded to bf16.
// That order does not depend on how many rows share the call or how threads split N, so a row gets
// the same bits alone (plain decoding) or among a tree's nodes (verification): the kernel is
// row-invariant, and exact mode needs no padding on it.
//
// The kernel itself; gguf_bf16.cpp binds it for Python and head_step.cpp calls it directly.
#pragma once
#include "torch_ext.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gguf_quants.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__) && defined(__F16C__)
#include <immintrin.h>
#define EYAS_GGUF_BF16 1
#endif

#include "gguf_q4_packed.h"  // after EYAS_GGUF_BF16: Q4 blocks in the kernel's own layout, few rows in registers

namespace eyas_gguf_bf16 {
namespace {  // internal linkage: each module that includes this has its own copy

using namespace eyas_gguf;
using namespace eyas_q4_packed;

#ifdef EYAS_GGUF_BF16
inline float half_f16c(const uint8_t* p) {  // the hardware conversion (c10::Half's is bit manipulation in software)
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// one block -> 32 bf16 weights in one register, low 16 = weights 0..15
//
// Q4_*: a block has 16 possible weights, so the 16 are computed once (d * q + m for q = 0..15 in float32, rounded
// to bf16) and the 32 nibbles pick from that table (VPERMW): ~12 instructions a block instead of ~17 for
// converting all 32 quants (measured: SmolLM2's Q4_1 layers at one row 61 -> 56 us for [3072, 576], Zen 5).
inline __m512i dequant_block(const uint8_t* blk, int64_t qtype) {
  const __m512 d = _mm512_set1_ps(half_f16c(blk));
  if (qtype == Q8_0) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    const __m512 lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)));
    const __m512 hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // round to nearest even, as torch's float -> bf16
  }
  __m512 table;
  if (qtype == Q4_1) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    table = _mm512_add_ps(_mm512_mul_ps(d, q), _mm512_set1_ps(half_f16c(blk + 2)));
  } else {
    const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    table = _mm512_mul_ps(d, q);
  }
  const __m256i tab = (__m256i)_mm512_cvtneps_pbh(table);
  const int off = qtype == Q4_1 ? 4 : 2;
  const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off)));
  const __m256i lo = _mm256_and_si256(q, _mm256_set1_epi16(0x0F));
  const __m256i hi = _mm256_srli_epi16(q, 4);
  const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(tab));  // indices < 16 read the table only
}

// four float sums (+ bias) -> bf16 at dst, rounded as c10::BFloat16(float): NaN -> 0x7FC0, else to nearest even
inline void store_bf16x4(__m128 v, uint16_t* dst) {
  const __m128i u = _mm_castps_si128(v);
  const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  __m128i r = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm_mask_blend_epi32(_mm_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm_set1_epi32(0x7FC0));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_cvtepi32_epi16(r));
}

constexpr int NB = 4;      // weight rows per group
constexpr int MR = 4;      // input rows per register block
constexpr int MAX_M = 64;  // input rows per pass over a group's dequantised weights
constexpr int PF_GROUPS = 2;  // software prefetch distance, in groups

// Per-CPU choices that change no bit (each accumulator's chain is the same either way), only the time: set once per
// machine by eyas.models.gguf_tuning from a timing at load (set_tuning).
//   prefetch: with several rows, each block's dequantisation prefetches the same block of the group PF_GROUPS ahead,
//             so the weights stream from memory while the rows' products are computed (without it a multi-row call
//             is memory time + math time). Spread one a block: all of a group's lines at once measured slower on
//             Zen 4 (they fill the miss queue ahead of the group's own loads). Zen 4, 121 projections, one process
//             (scripts/kernel_ab.py --base HEAD --base-tuning 0,0 --tuning 1,0): 2-3 rows 0.99x the time without
//             it, 4 / 6 / 8 rows 0.94x / 0.93x / 0.90x. The prefetch is non-temporal (PREFETCHNTA): weights read
//             once, they displace less of what the step touches next from the L3 (the draft head's weights, the code
//             and data of the calls between kernels). Whole exact-mode steps at 1 / 2 / 3 / 4 nodes, NTA against T0,
//             three one-process runs on Zen 4 (scripts/kernel_ab.py --base HEAD --steps --rows 2,3,4):
//             0.951-0.982x / 0.97-1.08x / 0.987-0.998x / 0.986-0.999x the time; the same bits.
//   pair_as_triple: 2 rows run as a 3-row block, the third repeating the second into scratch (Zen 5: 2-row chains
//             measured slower than 3-row ones; Zen 4, double-pumped AVX-512, pays for the extra row's math)
//   fma_rows: several rows multiply in float32 FMAs instead of VDPBF16PS (below); set only where fma_matches() holds.
//   prefetch_one: one row (plain decoding) prefetches as several rows do. Measured no better on Zen 5; on an Intel
//             Xeon 6/207 the 121 projections at one row took 8.9 ms with it against 10.7-11.3 without.
//   fused_rows: up to FUSED_ROWS rows of packed Q4 blocks multiply each block in registers as it is dequantised
//             (rows_packed) instead of through the L1 buffer (measured faster on the Intel Xeon 6/207; dequantising
//             inside the accumulation chains measured slower on Zen 5 for the GGUF layout's Q8_0, so it is timed).
struct Tuning {
  bool prefetch = true;
  bool pair_as_triple = true;
  bool fma_rows = false;
  bool prefetch_one = false;
  bool fused_rows = true;
};
Tuning tuning;

// rows x[0 .. mr) against NR weights given as bf16 vectors per block (w[j] + 32 * b); out[i * ldo + j] (float)
template <int MRr, int NR>
inline void micro(const uint16_t* const* x, const uint16_t* const* w, int64_t nblk, float* out, int64_t ldo) {
  __m512 acc[MRr][NR];
  for (int i = 0; i < MRr; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblk; ++b) {
    __m512i wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512(w[j] + QK * b);
    for (int i = 0; i < MRr; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[i] + QK * b);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, (__m512bh)wv[j]);
    }
  }
  for (int i = 0; i < MRr; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = reduce16(acc[i][j]);
}

// VDPBF16PS in float32 FMAs, for several rows. The instruction is, per lane l, two float32 FMAs with round to nearest
// even, denormal inputs read as zero and denormal results flushed: acc += x[2l+1] * w[2l+1], then acc += x[2l] * w[2l]
// (Intel SDM). A bf16 is the high half of a float32, so the odd weight of a lane is its 32 bits masked, the even one
// shifted up 16: the same two FMAs give the same bits, so long as no denormal appears. None does when every nonzero
// |x| >= 2^-60 (split_rows): GGUF weights are multiples of 2^-24 (fp16 scales and offsets), x then of 2^-67, their
// products of 2^-91, and every rounded sum of them a multiple of 2^-91 too, far above float32's 2^-126. On a CPU
// whose VDPBF16PS issues at half the FMA rate (Intel Xeon 6/207: 44 against 88 G multiply-adds/s a core, scripts/
// dot_peak.cpp), two FMAs cost what one VDPBF16PS does; x is split once per call (x32: per block, the 16 odd then the
// 16 even values as float32, split_block's layout), a weight vector in registers once per block for all the rows
// (splitting the weights into a float32 buffer instead measured slower: 2 / 3 rows 11.8 / 12.8 ms against 10.9 /
// 12.0 for the 121 projections, where VDPBF16PS took 11.7 / 13.1).
inline void split_block(__m512i v, float* dst) {
  _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))));
  _mm512_storeu_ps(dst + 16, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
}

template <int MRr, int NR>
inline void micro_fma(const float* const* x, const uint16_t* const* w, int64_t nblk, float* out, int64_t ldo) {
  __m512 acc[MRr][NR];
  for (int i = 0; i < MRr; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t b = 0; b < nblk; ++b) {
    __m512i wb[NR];
    for (int j = 0; j < NR; ++j) wb[j] = _mm512_loadu_si512(w[j] + QK * b);
    for (int half = 0; half < 2; ++half) {  // odd products first, as VDPBF16PS
      __m512 wv[NR];
      for (int j = 0; j < NR; ++j)
        wv[j] = _mm512_castsi512_ps(half == 0 ? _mm512_and_si512(wb[j], high) : _mm512_slli_epi32(wb[j], 16));
      for (int i = 0; i < MRr; ++i) {
        const __m512 xv = _mm512_loadu_ps(x[i] + QK * b + 16 * half);
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MRr; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = reduce16(acc[i][j]);
}

// one weight row w (GGUF or packed blocks, qtype) -> its nblk blocks as bf16 at dst; pj: where to prefetch the same
// bytes of a row ahead, or null. scales: room for 2 * nblk floats (packed rows).
inline void dequant_row(const uint8_t* w, int64_t nblk, int64_t bb, int64_t qtype, uint16_t* dst, const uint8_t* pj,
                        float* scales) {
  if (qtype >= PACKED) {  // nibbles at w, then nblk scales, then (Q4_1) nblk minimums, each fp16
    scales_f32(w + 16 * nblk, qtype == PACKED + Q4_1 ? 2 * nblk : nblk, scales);
    for (int64_t b = 0; b < nblk; ++b) {  // bb * b strides over the whole row, scales included, as below
      if (pj) _mm_prefetch(reinterpret_cast<const char*>(pj + bb * b), _MM_HINT_NTA);
      const __m512i v = qtype == PACKED + Q4_1 ? dequant_packed<true>(w + 16 * b, scales + b, scales + nblk + b)
                                               : dequant_packed<false>(w + 16 * b, scales + b, nullptr);
      _mm512_storeu_si512(dst + QK * b, v);
    }
    return;
  }
  for (int64_t b = 0; b < nblk; ++b) {
    if (pj) _mm_prefetch(reinterpret_cast<const char*>(pj + bb * b), _MM_HINT_NTA);
    _mm512_storeu_si512(dst + QK * b, dequant_block(w + bb * b, qtype));
  }
}

// The rows x[0 .. m) against one group's NR weight rows: each row's sums into out[i * ldo + j]. x32: the rows split
// for micro_fma, or null for VDPBF16PS on bf16 x. scales: room for NR * 2 * nblk floats (packed rows).
template <int NR>
void group(const uint16_t* xd, const float* x32, int64_t m, const uint8_t* const* w, int64_t k, int64_t bb,
           int64_t qtype, uint16_t* buf, float* scales, float* out, int64_t ldo, const uint8_t* pf) {
  if (tuning.fused_rows && qtype >= PACKED && m <= FUSED_ROWS) {
    if (qtype == PACKED + Q4_1) fused<NR, true>(xd, x32, m, k, w, bb, scales, out, ldo, pf);
    else fused<NR, false>(xd, x32, m, k, w, bb, scales, out, ldo, pf);
    return;
  }
  // dequantised into an L1-sized buffer first, also for one row: independent blocks keep more of them in flight
  // than dequantising inside the accumulation chain (measured: 1-row [49152, 576] Q8_0 1.47 -> 0.79 ms, Zen 5).
  // pf: where the group PF_GROUPS ahead starts (its row j block b prefetched beside this one's), or null
  const int64_t nblk = k / QK;
  const uint16_t* ws[NR];
  for (int j = 0; j < NR; ++j) {
    const uint8_t* pj = pf ? pf + (w[j] - w[0]) : nullptr;  // the rows of a group are consecutive, as are the groups
    dequant_row(w[j], nblk, bb, qtype, buf + j * k, pj, scales);
    ws[j] = buf + j * k;
  }
  if (x32) {  // 4 rows a block (16 accumulators, 4 weight and 1 row vector), the last 1-3, or 5 in one (30 registers)
    const float* xs[5];
    for (int64_t i = 0; i < m;) {
      const int64_t left = m - i;
      const int rows = left == 5 ? 5 : static_cast<int>(std::min<int64_t>(left, MR));
      for (int r = 0; r < rows; ++r) xs[r] = x32 + (i + r) * k;
      float* o = out + i * ldo;
      switch (rows) {
        case 5: micro_fma<5, NR>(xs, ws, nblk, o, ldo); break;
        case 4: micro_fma<4, NR>(xs, ws, nblk, o, ldo); break;
        case 3: micro_fma<3, NR>(xs, ws, nblk, o, ldo); break;
        case 2: micro_fma<2, NR>(xs, ws, nblk, o, ldo); break;
        default: micro_fma<1, NR>(xs, ws, nblk, o, ldo); break;
      }
      i += rows;
    }
    return;
  }
  // Register blocks of rows: 4 at a time, the last 1-3 in one block, but 5 remaining rows in one block (20
  // accumulators fit the 32 registers, where 4 + 1 re-loads every weight vector for the last row) and 6 as 3 + 3
  // (24 accumulators spill). 2 rows run as a 3-row block (the third repeats the second, into scratch): 2-row chains
  // measured slower than 3-row ones. Each accumulator's chain is the same whatever the block's shape, so none of
  // this changes a bit. Measured, Zen 5, SmolLM2's 121 projections, alternating processes (ms; scripts/
  // projection_cost.py): 5 rows 5.42-5.76 -> 5.01-5.27, 6 rows 6.35-6.42 -> 5.56-5.84, 2 rows 4.88-4.95 -> 4.67-4.77.
  const uint16_t* xs[5];
  int64_t i = 0;
  while (i < m) {
    const int64_t left = m - i;
    const int rows = left == 5 ? 5 : left == 6 ? 3 : static_cast<int>(std::min<int64_t>(left, MR));
    for (int r = 0; r < rows; ++r) xs[r] = xd + (i + r) * k;
    float* o = out + i * ldo;
    switch (rows) {
      case 5: micro<5, NR>(xs, ws, nblk, o, ldo); break;
      case 4: micro<4, NR>(xs, ws, nblk, o, ldo); break;
      case 3: micro<3, NR>(xs, ws, nblk, o, ldo); break;
      case 2: {
        if (!tuning.pair_as_triple) {
          micro<2, NR>(xs, ws, nblk, o, ldo);
          break;
        }
        float scratch[3 * NR];
        xs[2] = xs[1];
        micro<3, NR>(xs, ws, nblk, scratch, NR);
        for (int r = 0; r < 2; ++r)
          for (int j = 0; j < NR; ++j) o[r * ldo + j] = scratch[r * NR + j];
        break;
      }
      default: micro<1, NR>(xs, ws, nblk, o, ldo); break;
    }
    i += rows;
  }
}

// x [M, K] bf16 -> x32 split per block for micro_fma; false (x32 untouched past the first bad value) where a nonzero
// |x| < 2^-60 or a denormal could make the FMAs' bits differ from VDPBF16PS's (micro_fma)
bool split_rows(const uint16_t* x, int64_t count, float* x32) {
  const __m512i mag = _mm512_set1_epi32(0x7FFF0000), tiny = _mm512_set1_epi32((127 - 60) << 23);
  for (int64_t b = 0; b < count / QK; ++b) {
    const __m512i v = _mm512_loadu_si512(x + QK * b);
    const __m512i odd = _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __m512i even = _mm512_slli_epi32(v, 16);
    const __m512i ao = _mm512_and_si512(odd, mag), ae = _mm512_and_si512(even, mag);
    const __mmask16 bad = (_mm512_cmpgt_epi32_mask(tiny, ao) & _mm512_test_epi32_mask(ao, ao)) |
                          (_mm512_cmpgt_epi32_mask(tiny, ae) & _mm512_test_epi32_mask(ae, ae));
    if (bad) return false;
    split_block(v, x32 + QK * b);
  }
  return true;
}

// whether this CPU's VDPBF16PS gives the bits of micro_fma's two FMAs (the Intel SDM's definition): random rows of
// mixed magnitudes and signs, sums that cancel, 4 KiB of products, compared lane for lane
bool fma_matches() {
  uint32_t state = 12345u;
  auto next = [&state]() { state = state * 1664525u + 1013904223u; return state; };
  alignas(64) uint16_t x[QK], w[QK];
  alignas(64) float x32[QK], w32[QK], a[16], b[16];
  for (int trial = 0; trial < 4096; ++trial) {
    for (int j = 0; j < QK; ++j) {
      // exponents within 2^-20 .. 2^20 around 1 (well inside micro_fma's no-denormal range), random mantissas
      const uint32_t e = 127 - 20 + next() % 41, sign = (next() >> 7) & 1, mant = (next() >> 9) & 0x7F;
      x[j] = static_cast<uint16_t>((sign << 15) | (e << 7) | mant);
      const uint32_t e2 = 127 - 20 + next() % 41, s2 = (next() >> 5) & 1, m2 = (next() >> 11) & 0x7F;
      w[j] = static_cast<uint16_t>((s2 << 15) | (e2 << 7) | m2);
    }
    if (trial % 4 == 0)  // cancellation: the odd product the negated even one (each lane's sum near zero)
      for (int j = 0; j < QK; j += 2) { x[j + 1] = x[j] ^ 0x8000; w[j + 1] = w[j]; }
    const uint32_t acc_bits = (127 - 10 + next() % 21) << 23 | (next() & 0x7FFFFF);
    const __m512 acc = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(acc_bits)));
    const __m512i xv = _mm512_loadu_si512(x), wv = _mm512_loadu_si512(w);
    _mm512_storeu_ps(a, _mm512_dpbf16_ps(acc, (__m512bh)xv, (__m512bh)wv));
    split_block(xv, x32);
    split_block(wv, w32);
    __m512 f = _mm512_fmadd_ps(_mm512_loadu_ps(x32), _mm512_loadu_ps(w32), acc);
    f = _mm512_fmadd_ps(_mm512_loadu_ps(x32 + 16), _mm512_loadu_ps(w32 + 16), f);
    _mm512_storeu_ps(b, f);
    if (std::memcmp(a, b, sizeof a) != 0) return false;
  }
  return true;
}
#endif

// blocks [N, K / 32 * block_bytes] uint8 -> [N, K] bf16: the weights the kernel multiplies with (load check, tests)
at::Tensor dequantize(at::Tensor blocks, int64_t qtype, int64_t k) {
  const int64_t bb = block_bytes(qtype);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && k % QK == 0 && blocks.size(1) == k / QK * bb,
              "gguf_bf16.dequantize: blocks [N, K / 32 * ", bb, "] uint8 for K = ", k);
  blocks = blocks.contiguous();
  const int64_t n = blocks.size(0), nblk = k / QK;
  auto out = at::empty({n, k}, blocks.options().dtype(at::kBFloat16));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n * nblk, 1024, [&](int64_t b0, int64_t b1) {
    float tmp[QK];
    for (int64_t b = b0; b < b1; ++b) {
      dequant_block_f32(src + b * bb, qtype, tmp);
      for (int j = 0; j < QK; ++j) dst[b * QK + j] = c10::BFloat16(tmp[j]);  // round to nearest even
    }
  });
  return out;
}

// x [M, K] bf16, blocks [N, K / 32 * block_bytes] uint8 as GGUF (qtype) or packed (PACKED + qtype), bias [N] or
// empty -> [M, N] bf16
at::Tensor linear(at::Tensor x, at::Tensor blocks, int64_t qtype, at::Tensor bias) {
#ifdef EYAS_GGUF_BF16
  TORCH_CHECK(qtype < PACKED || packable(qtype - PACKED), "gguf_bf16.linear: unknown type code ", qtype);
  const int64_t gguf_type = qtype % PACKED, bb = block_bytes(gguf_type);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "gguf_bf16.linear: x [M, K] bfloat16");
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  const at::Tensor b32 = checked_bias("gguf_bf16.linear", x, blocks, gguf_type, bias);  // blocks, bias checked
  const float* bd = b32.defined() ? b32.data_ptr<float>() : nullptr;
  x = x.contiguous();
  auto out = at::empty({m, n}, x.options());
  const uint16_t* xd = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const uint8_t* wd = blocks.data_ptr<uint8_t>();
  c10::BFloat16* od = out.data_ptr<c10::BFloat16>();
  const int64_t row_bytes = blocks.size(1), groups = (n + NB - 1) / NB;
  // several rows in FMAs where this CPU's tuning says so and x has no value that could make their bits differ
  std::unique_ptr<float[]> x32v(tuning.fma_rows && m > 1 ? new float[m * k] : nullptr);  // not zeroed: all written
  const float* x32 = x32v && split_rows(xd, m * k, x32v.get()) ? x32v.get() : nullptr;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    // the dequantised weights on a 4 KiB boundary: where malloc put them, their stores could alias (in the low 12
    // address bits) the loads of x that follow, and a call's time changed with x's address by up to 17 % (Zen 4, 1
    // row); aligned, 121 projections measured 0.94x / 0.89x / 0.87x the unaligned time at 1 / 2 / 3 rows (one
    // process, the two builds alternating)
    std::vector<uint16_t> raw(static_cast<size_t>(NB * k + 2048));
    uint16_t* buf = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(raw.data()) + 4095) & ~uintptr_t(4095));
    std::vector<float> scales(static_cast<size_t>(NB * 2 * (k / QK)));
    float acc[MAX_M * NB];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t j0 = g * NB, nr = std::min<int64_t>(NB, n - j0);
      const uint8_t* ws[NB];
      for (int64_t j = 0; j < nr; ++j) ws[j] = wd + (j0 + j) * row_bytes;
      // the group PF_GROUPS ahead, fetched while this one computes, where this CPU gains from it (tuning.prefetch
      // for several rows, tuning.prefetch_one for one)
      const bool fetch = m > 1 ? tuning.prefetch : tuning.prefetch_one;
      const uint8_t* pf = fetch && g + PF_GROUPS < g1 ? ws[0] + PF_GROUPS * NB * row_bytes : nullptr;
      for (int64_t i0 = 0; i0 < m; i0 += MAX_M) {  // rows in chunks: each row's sums are the same in any chunk
        const int64_t mc = std::min<int64_t>(MAX_M, m - i0);
        const float* x32c = x32 ? x32 + i0 * k : nullptr;  // this chunk's rows, split (or null: VDPBF16PS)
        if (nr == NB) {  // then the bias in float32 and one rounding to nearest even, as below
          group<NB>(xd + i0 * k, x32c, mc, ws, k, bb, qtype, buf, scales.data(), acc, NB, i0 == 0 ? pf : nullptr);
          const __m128 bias4 = bd ? _mm_loadu_ps(bd + j0) : _mm_setzero_ps();
          for (int64_t i = 0; i < mc; ++i) {
            const __m128 v = _mm_loadu_ps(acc + i * NB);
            store_bf16x4(bd ? _mm_add_ps(v, bias4) : v, reinterpret_cast<uint16_t*>(od + (i0 + i) * n + j0));
          }
        } else {
          for (int64_t j = 0; j < nr; ++j)
            group<1>(xd + i0 * k, x32c, mc, ws + j, k, bb, qtype, buf, scales.data(), acc + j, NB, nullptr);
          for (int64_t i = 0; i < mc; ++i)  // bias in float32, then one rounding to nearest even
            for (int64_t j = 0; j < nr; ++j)
              od[(i0 + i) * n + j0 + j] = c10::BFloat16(bd ? acc[i * NB + j] + bd[j0 + j] : acc[i * NB + j]);
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "gguf_bf16.linear: built without AVX512-BF16");
#endif
}

bool fma_rows_exact() {
#ifdef EYAS_GGUF_BF16
  static const bool exact = fma_matches();  // once a process (4,096 trials)
  return exact;
#else
  return false;
#endif
}

void set_tuning(bool prefetch, bool pair_as_triple, bool fma_rows, bool prefetch_one, bool fused_rows) {
#ifdef EYAS_GGUF_BF16
  TORCH_CHECK(!fma_rows || fma_rows_exact(), "gguf_bf16.set_tuning: fma_rows needs this CPU's VDPBF16PS to give ",
              "the bits of two float32 FMAs (fma_rows_exact() is false here)");
  tuning.prefetch = prefetch;
  tuning.pair_as_triple = pair_as_triple;
  tuning.fma_rows = fma_rows;
  tuning.prefetch_one = prefetch_one;
  tuning.fused_rows = fused_rows;
#endif
}


bool available() {
#ifdef EYAS_GGUF_BF16
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace eyas_gguf_bf16

// Q4 blocks in gguf_bf16.cpp's own layout, and a few rows multiplied in registers as each block is dequantised
// (reduce16, the lanes' fixed summation tree, is here too: both kernels end with it). Included by gguf_bf16.cpp
// after it defines EYAS_GGUF_BF16 (AVX512-BF16 at compile time); pack() builds anywhere.
#pragma once

#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#include "gguf_quants.h"

namespace eyas_q4_packed {

using namespace eyas_gguf;

constexpr int64_t PACKED = 100;  // the type code of a packed layout (dequant_packed): PACKED + the GGML type
// rows_packed's most rows: past them gguf_bf16.cpp shares a block's dequantisation among more rows through a buffer
constexpr int FUSED_ROWS = 4;

inline bool packable(int64_t qtype) { return qtype == Q4_0 || qtype == Q4_1; }

// blocks [N, K / 32 * block_bytes] uint8 (Q4_0 or Q4_1) -> the same bytes in the kernel's packed layout, whose type
// code is PACKED + qtype (see dequant_packed)
inline at::Tensor pack(at::Tensor blocks, int64_t qtype, int64_t k) {
  TORCH_CHECK(packable(qtype), "gguf_bf16.pack: Q4_0 or Q4_1 blocks only, got GGML type ", qtype);
  const int64_t bb = block_bytes(qtype), nblk = k / QK, lead = qtype == Q4_1 ? 4 : 2;
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && k % QK == 0 && blocks.size(1) == nblk * bb,
              "gguf_bf16.pack: blocks [N, K / 32 * ", bb, "] uint8 for K = ", k);
  blocks = blocks.contiguous();
  auto out = at::empty_like(blocks);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks.size(0), 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nblk; ++b) {
        const uint8_t* blk = src + (r * nblk + b) * bb;
        uint8_t* row = dst + r * nblk * bb;
        uint8_t q[QK];  // GGUF: byte j holds weight j (low nibble) and weight j + 16 (high)
        for (int j = 0; j < QK / 2; ++j) q[j] = blk[lead + j] & 0x0F, q[j + QK / 2] = blk[lead + j] >> 4;
        for (int w = 0; w < 8; ++w) {  // word w: weights w, w + 8, w + 16, w + 24 (little-endian)
          row[16 * b + 2 * w] = static_cast<uint8_t>(q[w] | q[w + 8] << 4);
          row[16 * b + 2 * w + 1] = static_cast<uint8_t>(q[w + 16] | q[w + 24] << 4);
        }
        std::memcpy(row + 16 * nblk + 2 * b, blk, 2);  // d
        if (qtype == Q4_1) std::memcpy(row + 18 * nblk + 2 * b, blk + 2, 2);  // m
      }
  });
  return out;
}

#ifdef EYAS_GGUF_BF16
// The kernel's own layout of Q4 blocks (pack()): a weight row's nibbles block by block (16 bytes a block), then its
// fp16 scales d, then (Q4_1) its fp16 minimums m: the GGUF row's bytes regrouped, the same size. A block's 16 bytes
// are 8 words, word s holding the nibbles of weights s, s + 8, s + 16 and s + 24 in its bits 0-3, 4-7, 8-11 and
// 12-15: the 16 bytes broadcast to the four 128-bit lanes of a register and lane L shifted right by 4 L leave weight
// 8 L + s's nibble at the bottom of word 8 L + s, an index into the block's table of 16 weights (VPERMW reads 5
// bits: the table is written twice over, so the next nibble's low bit in bit 4 picks the same entry). A group
// converts a row's scales to float32 once, 16 an instruction (scales_f32), and each block broadcasts its own from
// memory. The GGUF layout (dequant_block) costs per block a scalar load, conversion and broadcast of each scale and
// a widening, mask and insert of the nibbles, mostly on the shuffle port the lookup needs: dequantising alone
// measured 3.05 ns a Q4_1 block against 1.50 packed (one core, L1, Intel Xeon 6/207). The weights are the same bits
// as dequant_block's (d * q + m in float32, then round to nearest even).

// one packed block (nib: its 16 bytes; d, m: its scale and minimum in float32, m unused for Q4_0) -> 32 bf16 weights
template <bool Q41>
inline __m512i dequant_packed(const uint8_t* nib, const float* d, const float* m) {
  __m512 table;
  if (Q41) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(*d), q), _mm512_set1_ps(*m));
  } else {
    const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    table = _mm512_mul_ps(_mm512_set1_ps(*d), q);
  }
  const __m512i tab2 = (__m512i)_mm512_cvtne2ps_pbh(table, table);  // [t, t], rounded to nearest even
  const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nib)));
  const __m512i shift = _mm512_set_epi64(0x000C000C000C000C, 0x000C000C000C000C, 0x0008000800080008, 0x0008000800080008,
                                         0x0004000400040004, 0x0004000400040004, 0, 0);  // 4 L in lane L
  return _mm512_permutexvar_epi16(_mm512_srlv_epi16(v, shift), tab2);
}

// count fp16 values at src -> float32 at dst
inline void scales_f32(const uint8_t* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 live = count - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - i)) - 1);
    const __m256i h = _mm256_maskz_loadu_epi16(live, src + 2 * i);
    _mm512_mask_storeu_ps(dst + i, live, _mm512_cvtph_ps(h));
  }
}

inline float reduce16(__m512 v) {  // fixed tree: (l, l+8), (l, l+4), (l, l+2), (l, l+1)
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}

// Rows x[0 .. MRr) against a group's NR packed Q4 rows (Q41: Q4_1, else Q4_0) without the buffer: each block is
// dequantised in registers straight into every row's products (FMA: float32 FMAs on x32's split rows, as micro_fma;
// else VDPBF16PS on bf16 x, as micro), blocks in order: each output's chain is the buffered kernels', so the same
// bits. scales: room for NR * 2 * nblk floats; pf: where the group ahead starts, to prefetch (gguf_bf16.cpp's
// group()), or null.
template <int NR, int MRr, bool Q41, bool FMA>
void rows_packed(const uint16_t* x, const float* x32, int64_t k, const uint8_t* const* w, int64_t bb, float* scales,
                 float* out, int64_t ldo, const uint8_t* pf) {
  const int64_t nblk = k / QK, per = (Q41 ? 2 : 1) * nblk;
  for (int j = 0; j < NR; ++j) scales_f32(w[j] + 16 * nblk, per, scales + j * per);
  __m512 acc[MRr][NR];
  for (int i = 0; i < MRr; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t b = 0; b < nblk; ++b) {
    if (pf)
      for (int j = 0; j < NR; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(pf + (w[j] - w[0]) + bb * b), _MM_HINT_NTA);
    __m512 xo[MRr], xe[MRr];  // FMA: the rows' odd and even values of block b; else xo holds the bf16 pairs
    for (int i = 0; i < MRr; ++i) {
      if (FMA) {
        xo[i] = _mm512_loadu_ps(x32 + i * k + QK * b);
        xe[i] = _mm512_loadu_ps(x32 + i * k + QK * b + 16);
      } else {
        xo[i] = _mm512_castsi512_ps(_mm512_loadu_si512(x + i * k + QK * b));
      }
    }
    for (int j = 0; j < NR; ++j) {
      const float* sc = scales + j * per;
      const __m512i wb = dequant_packed<Q41>(w[j] + 16 * b, sc + b, sc + nblk + b);
      if (FMA) {  // odd products first, as VDPBF16PS
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(wb, high));
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(wb, 16));
        for (int i = 0; i < MRr; ++i) acc[i][j] = _mm512_fmadd_ps(xe[i], we, _mm512_fmadd_ps(xo[i], wo, acc[i][j]));
      } else {
        for (int i = 0; i < MRr; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xo[i], (__m512bh)wb);
      }
    }
  }
  for (int i = 0; i < MRr; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = reduce16(acc[i][j]);
}

// rows_packed for m <= FUSED_ROWS rows of x (FMA where x32 is given: several rows, or one that ends a call's chunk of
// MAX_M rows), the type's and row count's instance
template <int NR, bool Q41>
void fused(const uint16_t* x, const float* x32, int64_t m, int64_t k, const uint8_t* const* w, int64_t bb,
           float* scales, float* out, int64_t ldo, const uint8_t* pf) {
  switch (m * 2 + (x32 != nullptr)) {
    case 2: rows_packed<NR, 1, Q41, false>(x, x32, k, w, bb, scales, out, ldo, pf); break;
    case 3: rows_packed<NR, 1, Q41, true>(x, x32, k, w, bb, scales, out, ldo, pf); break;  // a chunk's last row
    case 4: rows_packed<NR, 2, Q41, false>(x, x32, k, w, bb, scales, out, ldo, pf); break;
    case 5: rows_packed<NR, 2, Q41, true>(x, x32, k, w, bb, scales, out, ldo, pf); break;
    case 6: rows_packed<NR, 3, Q41, false>(x, x32, k, w, bb, scales, out, ldo, pf); break;
    case 7: rows_packed<NR, 3, Q41, true>(x, x32, k, w, bb, scales, out, ldo, pf); break;
    case 8: rows_packed<NR, 4, Q41, false>(x, x32, k, w, bb, scales, out, ldo, pf); break;
    case 9: rows_packed<NR, 4, Q41, true>(x, x32, k, w, bb, scales, out, ldo, pf); break;
    default: TORCH_CHECK(false, "gguf_bf16: fused runs 1 to ", FUSED_ROWS, " rows, got ", m);
  }
}

#endif  // EYAS_GGUF_BF16

}  // namespace eyas_q4_packed

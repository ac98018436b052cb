// head_i8.cpp's body for AVX2 without AVX512-VNNI: the same sums, bit for bit.
//
// AVX2 has no unsigned-by-signed byte multiply that accumulates into int32 (VPDPBUSD); VPMADDUBSW sums byte pairs
// into int16 with saturation, so head_i8.cpp's xu = xq + 128 (up to 255) times q (up to 127) could saturate. Each
// input row is kept as xq (int8, |xq| <= 127) instead, and every product xq * q is taken as |q| * (xq with q's
// sign): VPABSB, VPSIGNB, VPMADDUBSW sum a pair to at most 2 * 128 * 127 = 32,512 < 2^15, VPMADDWD against ones
// widens the pairs into int32, exactly. So acc = sum_k xq[k] * q[n, k] directly, which is the VNNI build's
// acc - 128 * sums: the epilogue takes no offset (OFFSET 0) and a row's output has the same bits on either build.
//
// A group's weight rows are read one after another (each a sequential stream of K bytes against every input row),
// not four interleaved as the VNNI build does: on Zen 3 the interleaved reads of a Q8_0 output projection ran at
// ~5 GB/s a core against ~15 GB/s for one stream.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace eyas_head_i8 {

constexpr int32_t OFFSET = 0;  // acc already is sum xq * q
constexpr int64_t NB = 4;      // weight rows per group (run()'s unit; read one at a time here)
constexpr int MR = 4;          // input rows per pass over one weight row
constexpr int PASS_ROWS = 8;   // rows per pass() call (MR at a time)
constexpr int64_t CHUNK = 64;  // K a multiple of this (the VNNI build's: one contract for int8_rows.py)
constexpr int64_t STEP = 32;   // bytes per VPMADDUBSW

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 -> float32 exactly (the high half of the float's bits)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// one row of K values -> K bytes xq = round(x * 127 / amax) (the VNNI build's values before its + 128); returns the
// scale amax / 127 (0 for an all-zero row). The VNNI build's float operations (a maximum is exact in any order), so
// xq and the scale have its bits.
template <typename T>
float quantize_row(const T* x, int64_t k, int8_t* xq) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; c += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(x + c)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float inv = amax > 0 ? 127.0f / amax : 0.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' 128-bit lane interleave
  for (int64_t c = 0; c < k; c += 32) {
    __m256i q[4];
    for (int j = 0; j < 4; ++j) {
      q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + c + 8 * j), vinv));  // round to nearest even
      q[j] = _mm256_min_epi32(_mm256_max_epi32(q[j], lo), hi);
    }
    const __m256i b = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + c), b);
  }
  return amax / 127.0f;
}

inline int32_t hsum8(__m256i v) {  // integer: any order is exact
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// rows xq[i], i < R, against the weight row w: acc[i * NB] = sum_k xq[i][k] * w[k]. With ahead > 0, each 64 bytes
// read ask for the line ``ahead`` bytes on (a later group's).
template <int R>
inline void micro(const int8_t* const* xq, const int8_t* w, int64_t k, int32_t* acc, int64_t ahead) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i a[R];
  for (int i = 0; i < R; ++i) a[i] = _mm256_setzero_si256();
  for (int64_t c = 0; c < k; c += STEP) {
    if (ahead > 0 && c % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + c + ahead), _MM_HINT_T0);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c));
    const __m256i mag = _mm256_abs_epi8(q);  // -128 -> 128 as uint8: still exact
    for (int i = 0; i < R; ++i) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + c));
      a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, q)), ones));
    }
  }
  for (int i = 0; i < R; ++i) acc[i * NB] = hsum8(a[i]);
}

// the input rows quantised: xq [m][k] (int8)
struct Input {
  std::vector<int8_t> xq;
  std::vector<float> sx;

  template <typename T>
  Input(const T* x, int64_t m, int64_t k) : xq(m * k), sx(m) {
    for (int64_t i = 0; i < m; ++i) sx[i] = quantize_row(x + i * k, k, xq.data() + i * k);
  }
  // rows [i0, i0 + rows) against the group's NB weight rows ws, one weight row at a time: acc[r * NB + j]. The
  // first pass over each weight row prefetches ``ahead`` bytes on. Rows layout only (tiled is false: linear() checks).
  void pass(int64_t i0, int rows, int64_t k, const int8_t* const* ws, bool /*tiled*/, int32_t* acc,
            int64_t ahead) const {
    for (int64_t j = 0; j < NB; ++j)
      for (int r0 = 0; r0 < rows; r0 += MR) {
        const int8_t* xs[MR];
        const int n = rows - r0 < MR ? rows - r0 : MR;
        for (int r = 0; r < n; ++r) xs[r] = xq.data() + (i0 + r0 + r) * k;
        int32_t* out = acc + r0 * NB + j;
        const int64_t pre = r0 == 0 ? ahead : 0;
        switch (n) {
          case 4: micro<4>(xs, ws[j], k, out, pre); break;
          case 3: micro<3>(xs, ws[j], k, out, pre); break;
          case 2: micro<2>(xs, ws[j], k, out, pre); break;
          default: micro<1>(xs, ws[j], k, out, pre); break;
        }
      }
  }
};

}  // namespace eyas_head_i8

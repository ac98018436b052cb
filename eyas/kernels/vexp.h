// exp over float arrays in SIMD registers, and the row reductions a draft head's log-softmax needs.
//
// head_step.cpp's silu and log-softmax called libm's scalar expf: 8,192 of them a draft-vocabulary row, ~56 us a row
// on the Zen 5 VM, and a step computes ~3 rows (the extension's and a level's frontier), plus 2,304 a row for silu:
// ~0.2 ms of a ~6 ms speculative step. Here 16 (AVX-512) or 8 (AVX2) lanes at a time, ~2 us a row.
//
// exp: n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts, Cody-Waite), e^r by Cephes' expf polynomial on
// |r| <= ln 2 / 2, scaled by 2^n (VSCALEFPS; on AVX2 two exact multiplications by 2^(n/2), so results that underflow
// to denormals or overflow to inf round once, as libm's do). Within ~1 ulp of libm's expf (tests/drafters/
// test_vexp.py checks 2 ulp over a sweep of the float range), not the same bits: it is used only where the draft is
// computed, which can change only which tokens are drafted, never the verified output. path_attn.h's exp_neg16 is
// the same polynomial for x <= 0 with its own clamp and scaling; it stays apart because its bits are the target's
// exact-mode attention (plain decoding's outputs), which this file must not move.
//
// Numerics of the reductions: max is exact in any order; the sum of exps runs in the register's lanes, then the
// lanes in a fixed order, so a row's result does not depend on anything but the row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace eyas_vexp {
namespace {  // internal linkage: each module that includes this has its own copy

// Cephes expf: e^r ~ 1 + r + r^2 (((((P0 r + P1) r + P2) r + P3) r + P4) r + P5) for |r| <= ln 2 / 2
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;
// inputs clamped to [LO, HI] first: e^HI overflows to inf and e^LO underflows to 0, as e^x beyond them does
constexpr float HI = 88.8f, LO = -104.0f;

// the same polynomial in scalar code, for the tail of an AVX2 row (a build without AVX2 calls libm's expf)
inline float exp1(float x) {
  if (std::isnan(x)) return x;
  x = std::min(std::max(x, LO), HI);
  const float n = std::nearbyint(x * LOG2E);
  float r = std::fma(-n, LN2_HI, x);
  r = std::fma(-n, LN2_LO, r);
  float p = P0;
  for (float c : {P1, P2, P3, P4, P5}) p = std::fma(p, r, c);
  const float e = std::fma(p, r * r, r + 1.0f);
  const int ni = static_cast<int>(n), n1 = ni / 2;
  return std::ldexp(std::ldexp(e, n1), ni - n1);
}

#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512 keep = x;
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(HI)), _mm512_set1_ps(LO));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(P0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P5));
  const __m512 e = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_mask_mov_ps(_mm512_scalef_ps(e, n), is_nan, keep);
}
#elif defined(__AVX2__)
inline __m256 pow2i(__m256i k) {  // 2^k for k in -126 .. 127
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

inline __m256 exp8(__m256 x) {
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 keep = x;
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(HI)), _mm256_set1_ps(LO));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(P0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
  const __m256 e = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);  // -150 .. 128, split in two halves that are each a normal power of 2
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  return _mm256_blendv_ps(_mm256_mul_ps(_mm256_mul_ps(e, pow2i(n1)), pow2i(n2)), keep, is_nan);
}
#endif

// y[i] = e^x[i] for i < n (y may be x)
inline void exp_array(const float* x, float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, exp16(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 live = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, live, exp16(_mm512_maskz_loadu_ps(live, x + i)));
  }
  return;
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = exp1(x[i]);
#else
  for (; i < n; ++i) y[i] = std::exp(x[i]);
#endif
}

// x [v] -> out [v] = log_softmax(x) in float32: (x - max) - log(sum of e^(x - max)), out may be x
inline void log_softmax(const float* x, int64_t v, float* out) {
  int64_t i = 0;
  float mx = -INFINITY, sum = 0.0f;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= v; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  mx = _mm512_reduce_max_ps(m);
  for (; i < v; ++i) mx = std::max(mx, x[i]);
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 s = _mm512_setzero_ps();
  for (i = 0; i + 16 <= v; i += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + i), mv);
    _mm512_storeu_ps(out + i, d);
    s = _mm512_add_ps(s, exp16(d));
  }
  if (i < v) {
    const __mmask16 live = static_cast<__mmask16>((1u << (v - i)) - 1);
    const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + i), mv);
    _mm512_mask_storeu_ps(out + i, live, d);
    s = _mm512_add_ps(s, _mm512_maskz_mov_ps(live, exp16(d)));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  for (float l : lanes) sum += l;
#elif defined(__AVX2__)
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= v; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float l : lanes) mx = std::max(mx, l);
  for (; i < v; ++i) mx = std::max(mx, x[i]);
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 s = _mm256_setzero_ps();
  for (i = 0; i + 8 <= v; i += 8) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + i), mv);
    _mm256_storeu_ps(out + i, d);
    s = _mm256_add_ps(s, exp8(d));
  }
  _mm256_store_ps(lanes, s);
  for (float l : lanes) sum += l;
  for (; i < v; ++i) {
    out[i] = x[i] - mx;
    sum += exp1(out[i]);
  }
#else
  for (; i < v; ++i) mx = std::max(mx, x[i]);
  for (i = 0; i < v; ++i) {
    out[i] = x[i] - mx;
    sum += std::exp(out[i]);
  }
#endif
  const float ls = std::log(sum);
  for (i = 0; i < v; ++i) out[i] -= ls;
}

}  // namespace
}  // namespace eyas_vexp

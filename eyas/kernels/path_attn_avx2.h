// path_attn.cpp's AVX2 body (CPUs without AVX-512): one (row, KV head) of the tree attention over a float32 cache
// in a fixed order per row. Included by path_attn.cpp inside its anonymous namespace, after its own includes
// (<immintrin.h>, <cmath>, <cstdint>, f32_dot.h: reduce8, the fixed 8-lane reduction tree) and exp_neg's
// definition.
#pragma once

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define EYAS_PATH_AVX2 1
// exp_neg on 8 lanes (the same polynomial); 2^n built in the exponent bits (n >= -126 after the clamp: normal)
inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// value chunks (8 floats) a pass over the values accumulates: G * CH accumulators in at most 12 of the 16 registers
template <int G, int NV>
constexpr int value_chunks() {
  int ch = NV;
  while (ch > 1 && (G * ch > 12 || NV % ch != 0)) --ch;
  return ch;
}

// decode_one's AVX2 body (float32 cache): the queries scaled once and kept in L1, each key read once for the G
// queries (its dot products in two chains of 8 lanes, even and odd chunks, then summed and reduced by a fixed tree),
// the softmax in 8 lanes by logical index, the values in passes of value_chunks() chunks. A fixed order per row.
template <int G, int DH>
void decode_one_avx2(const float* q, const float* kb, const float* vb, int64_t ks, int64_t vs, int64_t total,
                     float sc, float* w, float* out, int64_t start, const int64_t* path) {
  constexpr int NV = DH / 8;
  static_assert(NV >= 2, "head_dim 16 or more (pick_group's sizes)");
  alignas(32) float qs[G * DH];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j)
      _mm256_store_ps(qs + g * DH + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(q + g * DH + 8 * j), _mm256_set1_ps(sc)));
  float m[G];
  for (int g = 0; g < G; ++g) m[g] = -INFINITY;
  for (int64_t i = 0; i < total; ++i) {
    const float* kr = kb + (i < start ? i : path[i - start]) * ks;
    __m256 kx[NV];
    for (int j = 0; j < NV; ++j) kx[j] = _mm256_loadu_ps(kr + 8 * j);
    for (int g = 0; g < G; ++g) {
      __m256 a0 = _mm256_mul_ps(_mm256_load_ps(qs + g * DH), kx[0]);
      __m256 a1 = _mm256_mul_ps(_mm256_load_ps(qs + g * DH + 8), kx[1]);
      for (int j = 2; j < NV; j += 2) {
        a0 = _mm256_fmadd_ps(_mm256_load_ps(qs + g * DH + 8 * j), kx[j], a0);
        if (j + 1 < NV) a1 = _mm256_fmadd_ps(_mm256_load_ps(qs + g * DH + 8 * (j + 1)), kx[j + 1], a1);
      }
      const float x = eyas_f32::reduce8(_mm256_add_ps(a0, a1));
      w[g * total + i] = x;
      m[g] = x > m[g] ? x : m[g];
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* wg = w + g * total;
    const __m256 mm = _mm256_set1_ps(m[g]);
    __m256 sum = _mm256_setzero_ps();
    int64_t i0 = 0;
    for (; i0 + 8 <= total; i0 += 8) {
      const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(wg + i0), mm));
      _mm256_storeu_ps(wg + i0, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (i0 < total) {  // the tail through a padded copy: lanes past total add 0
      alignas(32) float tail[8];
      const int64_t n = total - i0;
      for (int l = 0; l < 8; ++l) tail[l] = l < n ? wg[i0 + l] - m[g] : -INFINITY;
      __m256 e = exp_neg8(_mm256_load_ps(tail));
      const __m256 live = _mm256_cmp_ps(_mm256_load_ps(tail), _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      e = _mm256_and_ps(e, live);
      _mm256_store_ps(tail, e);
      for (int64_t l = 0; l < n; ++l) wg[i0 + l] = tail[l];
      sum = _mm256_add_ps(sum, e);
    }
    inv[g] = 1.0f / eyas_f32::reduce8(sum);
  }
  constexpr int CH = value_chunks<G, NV>();
  for (int c0 = 0; c0 < NV; c0 += CH) {
    __m256 acc[G][CH];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < CH; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < total; ++i) {
      const float* vr = vb + (i < start ? i : path[i - start]) * vs + 8 * c0;
      for (int g = 0; g < G; ++g) {
        const __m256 wi = _mm256_broadcast_ss(w + g * total + i);
        for (int j = 0; j < CH; ++j) acc[g][j] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vr + 8 * j), acc[g][j]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < CH; ++j)
        _mm256_storeu_ps(out + g * DH + 8 * (c0 + j), _mm256_mul_ps(acc[g][j], _mm256_set1_ps(inv[g])));
  }
}
#endif

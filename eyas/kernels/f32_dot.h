// The few-row float32 dot product whose order skinny_gemm.cpp and gguf_f32.cpp share: output (m, n) of x[m] and W[n]
// accumulated in 8 lanes (lane l takes k = l, l + 8, ...; fused multiply-add where the build has FMA), reduced by the
// fixed tree (l, l+4), (l, l+2), (l, l+1), then the k tail in order. One definition, so a projection read from GGUF
// blocks (gguf_f32.cpp) gives the bits the dense weight gives on the streaming kernel.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EYAS_F32_DOT_AVX2 1
#endif

namespace eyas_f32 {

#ifdef EYAS_F32_DOT_AVX2
inline float reduce8(__m256 v) {  // the fixed tree: (l, l+4), (l, l+2), (l, l+1)
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// rows x0 (and x1 when two) against weight rows w[0 .. nb-1]; out[i * ldo + j]
template <int MR, int NR>
inline void block(const float* const* x, const float* const* w, int64_t k8, int64_t k, float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k8; p += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w[j] + p);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x[i] + p);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = reduce8(acc[i][j]);
      for (int64_t p = k8; p < k; ++p) s += x[i][p] * w[j][p];
      out[i * ldo + j] = s;
    }
}
#else
template <int MR, int NR>
inline void block(const float* const* x, const float* const* w, int64_t k8, int64_t k, float* out, int64_t ldo) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t p = 0; p < k8; p += 8)
        for (int l = 0; l < 8; ++l) acc[l] += x[i][p + l] * w[j][p + l];
      for (int l = 0; l < 4; ++l) acc[l] += acc[l + 4];
      for (int l = 0; l < 2; ++l) acc[l] += acc[l + 2];
      float s = acc[0] + acc[1];
      for (int64_t p = k8; p < k; ++p) s += x[i][p] * w[j][p];
      out[i * ldo + j] = s;
    }
}
#endif

}  // namespace eyas_f32

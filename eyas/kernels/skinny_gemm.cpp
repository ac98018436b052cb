// y = x @ W^T + b for a few rows of float32 x (decoding, tree verification): W streamed from memory once.
//
// A CPU forward of a small model at a handful of rows is bound by reading the weights. MKL's sgemm
// re-reads (or repacks) W for 2-16 rows, so on the AVX2 VM a 2-row forward costs 1.5x a 1-row one
// (docs/benchmarks.md). Here each block of 4 weight rows is loaded from memory once and multiplied
// against every input row while it sits in L1, so 16 rows cost about what 1 row costs.
//
// Numerics: output (m, n) is the dot product of x[m] and W[n] accumulated in 8 lanes (lane l takes
// k = l, l + 8, ...; fused multiply-add where the build has FMA), reduced by the fixed tree
// (l, l+4), (l, l+2), (l, l+1), then the k tail in order, then the bias. That order does not
// depend on how many rows share the call or how threads split N: each row's result is the same
// bits whether it is computed alone (plain decoding) or among a tree's nodes (verification).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EYAS_SKINNY_AVX2 1
#endif

namespace {

constexpr int64_t NB = 4;       // weight rows per block, reused from L1 for every input row
constexpr int64_t MAX_ROWS = 32;

#ifdef EYAS_SKINNY_AVX2
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

template <int NR>
void rows_against(const float* xd, int64_t m, const float* const* w, int64_t k, float* out, int64_t n) {
  const int64_t k8 = k / 8 * 8;
  int64_t i = 0;
  for (; i + 2 <= m; i += 2) {
    const float* xs[2] = {xd + i * k, xd + (i + 1) * k};
    block<2, NR>(xs, w, k8, k, out + i * n, n);
  }
  if (i < m) {
    const float* xs[1] = {xd + i * k};
    block<1, NR>(xs, w, k8, k, out + i * n, n);
  }
}

// x [M, K] float32, w [N, K] float32, bias [N] or empty -> [M, N]; M <= max_rows()
torch::Tensor linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny linear: float32 only");
  TORCH_CHECK(x.size(0) <= MAX_ROWS, "skinny linear: at most ", MAX_ROWS, " rows");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto out = torch::empty({m, n}, x.options());
  const float* xd = x.data_ptr<float>();
  const float* wd = w.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t blocks = (n + NB - 1) / NB;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j0 = b * NB, nr = std::min<int64_t>(NB, n - j0);
      const float* ws[NB];
      for (int64_t j = 0; j < nr; ++j) ws[j] = wd + (j0 + j) * k;
      if (nr == NB) {
        rows_against<NB>(xd, m, ws, k, od + j0, n);
      } else {
        for (int64_t j = 0; j < nr; ++j) rows_against<1>(xd, m, ws + j, k, od + j0 + j, n);
      }
    }
  });
  if (bias.defined() && bias.numel()) out.add_(bias.to(at::kFloat));
  return out;
}

int64_t max_rows() { return MAX_ROWS; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ w.T + bias for a few float32 rows, w streamed once (CPU)");
  m.def("max_rows", &max_rows, "the most rows linear accepts");
}

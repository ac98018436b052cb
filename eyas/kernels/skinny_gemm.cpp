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
#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "f32_dot.h"  // the summation order (block, reduce8), shared with gguf_f32.cpp

namespace {

using namespace eyas_f32;

constexpr int64_t NB = 4;       // weight rows per block, reused from L1 for every input row
constexpr int64_t MAX_ROWS = 32;

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
at::Tensor linear(at::Tensor x, at::Tensor w, at::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny linear: float32 only");
  TORCH_CHECK(x.size(0) <= MAX_ROWS, "skinny linear: at most ", MAX_ROWS, " rows");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto out = at::empty({m, n}, x.options());
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

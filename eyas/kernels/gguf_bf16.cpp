// Python bindings of gguf_bf16.h (what it computes and why: there), and the output screen's last step.
#include "gguf_bf16.h"

#include <cmath>

using namespace eyas_gguf_bf16;

namespace {
// The output screen's last step (eyas.models.lm_screen): x [R, K] bf16, blocks [n, K / 32 * block bytes] uint8 (the
// output projection's GGUF blocks, qtype), cand [C] long (the screen's candidates, ascending) ->
// {logits [R, n] float32: linear()'s value at every candidate column, -inf elsewhere; greedy [R] long: the index
// argmax returns for that row (its first maximum, the first NaN before any number, 0 for a row of -inf)}. linear's
// outputs do not depend on which weight rows share a call, so a candidate's logit is the full projection's, bit for
// bit. One call instead of the gather, the fill, the scatter and verification's full-row argmax as torch ops (in
// place on Zen 4, alternating forwards: 1.30 against 1.41 ms a screened projection, the scan included).
std::vector<at::Tensor> at_candidates(at::Tensor x, at::Tensor blocks, int64_t qtype, at::Tensor cand, int64_t n) {
  TORCH_CHECK(cand.dim() == 1 && cand.scalar_type() == at::kLong, "gguf_bf16.at_candidates: cand [C] long");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == n, "gguf_bf16.at_candidates: blocks [n, bytes], n = ", n);
  TORCH_CHECK(x.dim() == 2, "gguf_bf16.at_candidates: x [R, K]");
  cand = cand.contiguous();
  const int64_t r = x.size(0), c = cand.size(0);
  const int64_t* ids = cand.data_ptr<int64_t>();
  for (int64_t j = 0; j < c; ++j)
    TORCH_CHECK(ids[j] >= 0 && ids[j] < n && (j == 0 || ids[j] > ids[j - 1]),
                "gguf_bf16.at_candidates: candidates must ascend within [0, ", n, ")");
  const at::Tensor y = linear(x, blocks.index_select(0, cand), qtype, at::Tensor()).to(at::kFloat).contiguous();
  auto logits = at::full({r, n}, -INFINITY, x.options().dtype(at::kFloat));
  auto greedy = at::empty({r}, x.options().dtype(at::kLong));
  const float* yd = y.data_ptr<float>();
  float* ld = logits.data_ptr<float>();
  int64_t* gd = greedy.data_ptr<int64_t>();
  for (int64_t i = 0; i < r; ++i) {
    int64_t best = 0;  // a row of -inf: index 0, as argmax
    float bv = -INFINITY;
    for (int64_t j = 0; j < c; ++j) {
      const float v = yd[i * c + j];
      ld[i * n + ids[j]] = v;
      if (!std::isnan(bv) && (std::isnan(v) || v > bv)) best = ids[j], bv = v;
    }
    gd[i] = best;
  }
  return {logits, greedy};
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ W.T + bias, bf16 rows x, W as GGUF Q4_0/Q4_1/Q8_0 blocks (AVX512-BF16)");
  m.def("at_candidates", &at_candidates,
        "the output screen's last step: (logits [R, n] exact at the candidates, -inf elsewhere; each row's argmax)");
  m.def("pack", &pack, "Q4_0 / Q4_1 blocks -> the kernel's packed layout of the same bytes (type PACKED + qtype)");
  m.def("packed_type", []() { return PACKED; }, "the type-code offset of the packed layouts");
  m.def("dequantize", &dequantize, "GGUF blocks -> the bf16 weights the kernel multiplies with");
  m.def("set_tuning", &set_tuning,
        "per-CPU speed choices that change no bit: prefetch, pair_as_triple, fma_rows, prefetch_one, fused_rows",
        py::arg("prefetch"), py::arg("pair_as_triple"), py::arg("fma_rows") = false, py::arg("prefetch_one") = false,
        py::arg("fused_rows") = true);
  m.def("fma_rows_exact", &fma_rows_exact, "whether this CPU's VDPBF16PS gives two float32 FMAs' bits (fma_rows)");
  m.def("available", &available, "whether linear was built (AVX512-BF16 and F16C at compile time)");
  m.def("block_bytes", &block_bytes, "bytes per 32-weight block of a GGML type");
}

// Python bindings of gguf_bf16.h (what it computes and why: there).
#include "gguf_bf16.h"

using namespace eyas_gguf_bf16;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ W.T + bias, bf16 rows x, W as GGUF Q4_0/Q4_1/Q8_0 blocks (AVX512-BF16)");
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

// Python bindings of path_attn.h (what it computes and why: there).
#include "path_attn.h"

using namespace eyas_path_attn;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("path_attention", &path_attention, "exact-mode tree attention (CPU)");
  m.def("decode_attention", &decode_attention, "batched one-token decode over per-row lengths (CPU)");
  m.def("decode_bf16", &decode_bf16, "whether decode_attention reads a bf16 cache (AVX-512 builds)");
  m.def("supports", &supports, "whether a (query heads per KV head, head_dim) pair has a kernel"); }

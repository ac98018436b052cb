// Python bindings of layer_ops.h (what it computes and why: there).
#include "layer_ops.h"

using namespace eyas_layer_ops;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_cache", &rope_cache, "RoPE on q and k, k and v into the cache, q as float32 (CPU, bf16 or float32)");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of a few float32 rows (CPU)");
}

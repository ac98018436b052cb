// Python bindings of head_i8.h (what it computes and why: there).
#include "head_i8.h"

using namespace eyas_head_i8;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ W.T + bias for a few rows: W per-row int8 (rows, or tiled: pack()), x quantised per "
        "row (AVX512-VNNI or AVX2)");
  m.def("pack", &pack, "W [N, K] int8 -> the layout linear() reads fastest here (tiled where tiles(), else W)");
  m.def("tiles", &tiles, "whether pack() tiles W (the AVX512-VNNI body)");
  m.def("set_prefetch", &set_prefetch, "software prefetch distance in weight groups (0: off); changes no bit");
  m.def("available", &available, "whether linear was built (AVX512-VNNI or AVX2 at compile time)");
  m.def("chunk", [] { return CHUNK; }, "K must be a multiple of this");
}

// Python bindings of rms_norm.h (what it computes and why: there).
#include "rms_norm.h"

using namespace eyas_rms_norm;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, float32 statistics, one rounding (CPU)");
}

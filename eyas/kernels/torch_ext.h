// What the kernels take from torch: tensors, ATen's factories and parallel_for, c10's half types, and pybind11 with
// torch's tensor caster for the module's bindings. Not <torch/extension.h>: that also pulls in the whole C++
// frontend (torch/all.h: modules, optimisers, data loaders), which took 23 s of each kernel's ~25 s build on two
// cores; these headers take ~8 s (torch 2.13, g++ -O3).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 (with stl.h), the at::Tensor caster, namespace py

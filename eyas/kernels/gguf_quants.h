// GGUF block formats shared by the block kernels (gguf_bf16.cpp, gguf_f32.cpp): sizes, and gguf-py's dequantisation
// as the scalar reference (the weights eyas's loader makes from the file, in float32).
//
// Dequantisation (gguf-py, gguf/quants.py), in float32, multiply then add, never fused (the kernels build with
// -ffp-contract=off): Q4_0 d * (q - 8); Q4_1 d * q + m; Q8_0 d * q. d and m are the block's fp16 scale and minimum.
// Within a 32-weight block of Q4_*, byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
#pragma once

#include "torch_ext.h"
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>

namespace eyas_gguf {

constexpr int QK = 32;                                  // weights per block
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // GGML type ids

constexpr int64_t block_bytes(int64_t qtype) {  // constexpr: the kernels' per-type templates take it at compile time
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: TORCH_CHECK(false, "gguf blocks: unsupported GGML type ", qtype, " (Q4_0, Q4_1, Q8_0 only)");
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// scalar reference: block -> 32 float32 weights, exactly gguf-py's arithmetic
inline void dequant_block_f32(const uint8_t* blk, int64_t qtype, float* out) {
  const float d = half_to_float(blk);
  if (qtype == Q8_0) {
    for (int j = 0; j < QK; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
    return;
  }
  const uint8_t* qs = blk + (qtype == Q4_1 ? 4 : 2);
  const float m = qtype == Q4_1 ? half_to_float(blk + 2) : 0.0f;
  for (int j = 0; j < QK / 2; ++j) {
    const int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
    if (qtype == Q4_1) {
      volatile float a = d * static_cast<float>(lo), b = d * static_cast<float>(hi);  // no fused multiply-add
      out[j] = a + m;
      out[j + QK / 2] = b + m;
    } else {
      out[j] = d * static_cast<float>(lo - 8);
      out[j + QK / 2] = d * static_cast<float>(hi - 8);
    }
  }
}

// linear(x [M, K], blocks, qtype, bias)'s shared checks (``who`` names the kernel in the message): blocks
// [N, K / 32 * block_bytes] contiguous uint8 for x's K, bias [N] or empty. Returns the bias as contiguous float32, or
// an undefined tensor where there is none.
inline at::Tensor checked_bias(const char* who, const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                                  const at::Tensor& bias) {
  const int64_t bb = block_bytes(qtype), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % QK == 0 && blocks.dim() == 2 && blocks.size(1) == k / QK * bb && blocks.is_contiguous(), who,
              ": blocks [N, K / 32 * ", bb, "] contiguous uint8 for K = ", k);
  const bool has_bias = bias.defined() && bias.numel();
  TORCH_CHECK(!has_bias || bias.numel() == n, who, ": bias [N]");
  return has_bias ? bias.to(at::kFloat).contiguous() : at::Tensor();
}

}  // namespace eyas_gguf

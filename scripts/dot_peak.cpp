// This CPU's peak rate for the multiply-adds a projection could use, one thread, registers only: VDPBF16PS (32 bf16
// products a 512-bit instruction: eyas/kernels/gguf_bf16.cpp's one-row path), VFMADD231PS (16 float32 ones: its
// several-row path where fma_rows is set), VFMADD231PS on 256-bit registers (8: gguf_f32.cpp's AVX2 path, the
// float32 kernel of an AVX2-only CPU) and VPDPBUSD (64 int8 ones: eyas/kernels/head_i8.cpp, lm_screen.cpp); each
// where the build has the instructions.
// Twelve independent accumulators each, held in registers (named variables with distinct starting values: an
// array of them was spilled to memory at -O2 and the loop timed store-to-load latency instead, which is what this
// file measured before 2026-11-29 and why benchmarks.md once called the block kernel's rows "at the bf16 peak").
//
//   g++ -O2 -march=native scripts/dot_peak.cpp -o /tmp/dot_peak && /tmp/dot_peak
#include <immintrin.h>

#include <chrono>
#include <cstddef>
#include <cstdio>

namespace {

const long kIters = 20000000;  // 12 instructions each

#define DOT_PEAK_12(T, OP)                                                                                        \
  T a0 = init(0), a1 = init(1), a2 = init(2), a3 = init(3), a4 = init(4), a5 = init(5), a6 = init(6), a7 = init(7), \
    a8 = init(8), a9 = init(9), a10 = init(10), a11 = init(11);                                                  \
  auto t0 = std::chrono::steady_clock::now();                                                                    \
  for (long r = 0; r < kIters; ++r) {                                                                            \
    a0 = OP(a0); a1 = OP(a1); a2 = OP(a2); a3 = OP(a3); a4 = OP(a4); a5 = OP(a5);                                \
    a6 = OP(a6); a7 = OP(a7); a8 = OP(a8); a9 = OP(a9); a10 = OP(a10); a11 = OP(a11);                            \
    __asm__ volatile("" : "+v"(x), "+v"(y));                                                                     \
  }                                                                                                              \
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();                 \
  T all[12] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};                                                \
  unsigned char folded = 0; /* every accumulator observed: none is dead code */                                   \
  for (size_t i = 0; i < sizeof(all); ++i) folded ^= reinterpret_cast<const unsigned char*>(all)[i];           \
  volatile unsigned char sink = folded;                                                                          \
  (void)sink;

#if defined(__AVX512BF16__)
void bf16() {
  auto init = [](int i) { return _mm512_set1_ps(0.001f * i); };
  __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3c00);
#define OP(a) _mm512_dpbf16_ps(a, x, y)
  DOT_PEAK_12(__m512, OP)
#undef OP
  std::printf("VDPBF16PS zmm  : %.2f G instructions/s = %5.1f G multiply-adds/s\n", 12 * kIters / s / 1e9,
              32 * 12 * kIters / s / 1e9);
}

#endif

#if defined(__AVX512F__)
void f32() {
  auto init = [](int i) { return _mm512_set1_ps(0.001f * i); };
  __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
#define OP(a) _mm512_fmadd_ps(x, y, a)
  DOT_PEAK_12(__m512, OP)
#undef OP
  std::printf("VFMADD231PS zmm: %.2f G instructions/s = %5.1f G multiply-adds/s\n", 12 * kIters / s / 1e9,
              16 * 12 * kIters / s / 1e9);
}

#endif

#if defined(__FMA__)
void f32_ymm() {  // AVX2 + FMA (the float32 block kernel's several-row path on an AVX2-only CPU)
  auto init = [](int i) { return _mm256_set1_ps(0.001f * i); };
  __m256 x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.9999f);
#define OP(a) _mm256_fmadd_ps(x, y, a)
  DOT_PEAK_12(__m256, OP)
#undef OP
  std::printf("VFMADD231PS ymm: %.2f G instructions/s = %5.1f G multiply-adds/s\n", 12 * kIters / s / 1e9,
              8 * 12 * kIters / s / 1e9);
}
#endif

#if defined(__AVX512VNNI__)
void i8() {
  auto init = [](int i) { return _mm512_set1_epi32(i); };
  __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(2);
#define OP(a) _mm512_dpbusd_epi32(a, x, y)
  DOT_PEAK_12(__m512i, OP)
#undef OP
  std::printf("VPDPBUSD zmm   : %.2f G instructions/s = %5.1f G multiply-adds/s\n", 12 * kIters / s / 1e9,
              64 * 12 * kIters / s / 1e9);
}

#endif

}  // namespace

int main() {  // what this CPU has: an AVX2-only one prints the ymm line alone
#if defined(__AVX512BF16__)
  bf16();
#endif
#if defined(__AVX512F__)
  f32();
#endif
#if defined(__FMA__)
  f32_ymm();
#endif
#if defined(__AVX512VNNI__)
  i8();
#endif
}

// This CPU's peak rate for the two multiply-adds a bf16 projection could use, one thread, registers only:
// VDPBF16PS (32 bf16 products a 512-bit instruction, what eyas/kernels/gguf_bf16.cpp runs) and VFMADD231PS
// (16 float32 ones), twelve independent accumulators each. The block kernel's cost per extra verify row is
// these products, so this is the floor under it (docs/benchmarks.md).
//
//   g++ -O2 -march=native scripts/dot_peak.cpp -o /tmp/dot_peak && /tmp/dot_peak
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  const long n = 240000000;  // instructions per kind
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
  auto t0 = std::chrono::steady_clock::now();
  for (long r = 0; r < n / 12; ++r) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));  // keep the loop from being folded
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0;
  for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  std::printf("VDPBF16PS zmm  : %.2f G instructions/s = %.1f G multiply-adds/s\n", n / s / 1e9, 32 * n / s / 1e9);
  __m512 fa = _mm512_set1_ps(1.0001f), fb = _mm512_set1_ps(0.9999f);
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  t0 = std::chrono::steady_clock::now();
  for (long r = 0; r < n / 12; ++r) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(fa, fb, acc[i]);
    __asm__ volatile("" : "+v"(fa), "+v"(fb));
  }
  s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  std::printf("VFMADD231PS zmm: %.2f G instructions/s = %.1f G multiply-adds/s  (%g)\n", n / s / 1e9, 16 * n / s / 1e9,
              sink);
}

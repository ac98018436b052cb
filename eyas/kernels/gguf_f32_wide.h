// The float32 block kernel's many-row path (AVX-512): prefill chunks and wide verify forwards, past 16 input rows.
// Part of gguf_f32.cpp: included inside its anonymous namespace, after dequant_block16 (the block rebuilt in
// registers) and reduce8's tree; every output keeps the sums (and bits) of the register path.
#pragma once

// pair buffer layout: chunk c of a pair holds row 2p's k in [8c, 8c + 8), then row 2p + 1's
inline void store_pair_half(float* pair, int64_t chunk, int half, __m512 v) {  // v = 16 weights = chunks c, c + 1
  float* dst = pair + 16 * chunk + 8 * half;
  _mm256_storeu_ps(dst, _mm512_castps512_ps256(v));
  _mm512_mask_storeu_ps(dst + 16 - 8, 0xFF00, v);  // lanes 8..15 to the next chunk's half, no shuffle
}

// Many rows (prefill): 8 weight rows rebuilt into the buffer as four pairs, and passes of up to 6 input rows against
// all four pairs: each input chunk loaded feeds 8 multiply-adds instead of 4 (half the reads of x per sum), 24 accumulators.
// Every output's lanes take the same k in the same order as on the other paths: the same bits.
constexpr int64_t WIDE_NB = 8;
constexpr int WIDE_MR = 6;

// Weights rebuilt per slice of at most WIDE_K inputs, so the slice's buffer (8 rows, at most 20 KB) and a pass's inputs stay
// in L1; the accumulators carry over between slices through memory (a store and a load: the same sums).
constexpr int64_t WIDE_K = 640;

// reduce8 of the 16 8-lane halves of a[0..3], b[0..3] at once (half h of a[p] is sum 2p + h, of b[p] sum 8 + 2p + h),
// returned in that order: the same tree per sum, (l, l+4), then (l, l+2), then (l, l+1), with a third of the
// instructions of 16 reduce8 calls (float addition is commutative, so the operands' order does not matter)
inline __m512 reduce8x16(const __m512* a, const __m512* b) {
  const __m512* v[8] = {&a[0], &a[1], &a[2], &a[3], &b[0], &b[1], &b[2], &b[3]};
  __m512 s[4], t[2];
  for (int r = 0; r < 4; ++r)  // quarter j of s[r]: lanes l + (l + 4) of sum 4r + j
    s[r] = _mm512_add_ps(_mm512_shuffle_f32x4(*v[2 * r], *v[2 * r + 1], 0x88),
                         _mm512_shuffle_f32x4(*v[2 * r], *v[2 * r + 1], 0xDD));
  for (int r = 0; r < 2; ++r)  // quarter j of t[r]: (l, l+2) of sum 8r + j (lanes 0, 1) and of 8r + 4 + j (2, 3)
    t[r] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * r], s[2 * r + 1], 0x44),
                         _mm512_shuffle_ps(s[2 * r], s[2 * r + 1], 0xEE));
  // lane 4j + c: (l, l+1) of sum 4c + j; then lane o takes sum o
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x88), _mm512_shuffle_ps(t[0], t[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), u);
}

// rows x[0 .. MR) (row stride ldx) against one slice's four pairs (kc chunks of 8); acc [MR * 4 * 16] carries the sums
// between slices: zeroed on the first, reduced into out[i * 8 + j] on the last
template <int MR>
__attribute__((noinline)) void wide_pass(const float* x, int64_t ldx, const float* const* pairs, int64_t kc,
                                         float* state, bool first, bool last, float* out) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < 4; ++p) acc[i][p] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(state + (i * 4 + p) * 16);
  for (int64_t c = 0; c < kc; ++c) {
    __m512 wv[4];
    for (int p = 0; p < 4; ++p) wv[p] = _mm512_loadu_ps(pairs[p] + 16 * c);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i * ldx + 8 * c));
      for (int p = 0; p < 4; ++p) acc[i][p] = _mm512_fmadd_ps(xv, wv[p], acc[i][p]);
    }
  }
  if (!last) {
    for (int i = 0; i < MR; ++i)
      for (int p = 0; p < 4; ++p) _mm512_storeu_ps(state + (i * 4 + p) * 16, acc[i][p]);
    return;
  }
  for (int i = 0; i < MR; i += 2) {  // two rows' 16 sums at once; an odd last row pairs with itself, half stored
    const __m512 sums = reduce8x16(acc[i], acc[i + 1 < MR ? i + 1 : i]);
    if (i + 1 < MR) _mm512_storeu_ps(out + i * 8, sums);
    else _mm512_mask_storeu_ps(out + i * 8, 0x00FF, sums);
  }
}

// m rows of x against the 8 weight rows whose blocks start at w[j] (a short group repeats its last row): out[i * 8 + j]
template <int64_t QT>
void wide_group_of(const float* xd, int64_t m, const uint8_t* const* w, int64_t k, std::vector<float>& buf,
                   std::vector<float>& state, float* out) {
  constexpr int64_t bb = block_bytes(QT);
  const int64_t slices = (k + WIDE_K - 1) / WIDE_K, ks = (k / QK + slices - 1) / slices * QK;  // even slices
  buf.resize(static_cast<size_t>(WIDE_NB * ks + 16));
  // the pairs on 64-byte lines: a 64-byte load across two lines measured ~6 % of the whole path at 32-128 rows
  float* base = buf.data() + ((64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64) / sizeof(float);
  state.resize(static_cast<size_t>(m * 4 * 16));
  const float* pairs[4] = {base, base + 2 * ks, base + 4 * ks, base + 6 * ks};
  for (int64_t k0 = 0; k0 < k; k0 += ks) {
    const int64_t kn = std::min(ks, k - k0);
    for (int j = 0; j < WIDE_NB; ++j)
      for (int64_t b = 0; b < kn / QK; ++b) {
        __m512 lo, hi;
        dequant_block16<QT>(w[j] + bb * (k0 / QK + b), lo, hi);
        store_pair_half(base + (j / 2) * 2 * ks, 4 * b, j % 2, lo);
        store_pair_half(base + (j / 2) * 2 * ks, 4 * b + 2, j % 2, hi);
      }
    const bool first = k0 == 0, last = k0 + kn == k;
    for (int64_t i = 0; i < m;) {
      const int rows = static_cast<int>(std::min<int64_t>(m - i, WIDE_MR));
      const float* x = xd + i * k + k0;
      float* st = state.data() + i * 4 * 16;
      float* o = out + i * WIDE_NB;
      switch (rows) {
        case 6: wide_pass<6>(x, k, pairs, kn / 8, st, first, last, o); break;
        case 5: wide_pass<5>(x, k, pairs, kn / 8, st, first, last, o); break;
        case 4: wide_pass<4>(x, k, pairs, kn / 8, st, first, last, o); break;
        case 3: wide_pass<3>(x, k, pairs, kn / 8, st, first, last, o); break;
        case 2: wide_pass<2>(x, k, pairs, kn / 8, st, first, last, o); break;
        default: wide_pass<1>(x, k, pairs, kn / 8, st, first, last, o); break;
      }
      i += rows;
    }
  }
}

void wide_group(const float* xd, int64_t m, const uint8_t* const* w, int64_t k, int64_t qtype, std::vector<float>& buf,
                std::vector<float>& state, float* out) {
  switch (qtype) {
    case Q8_0: wide_group_of<Q8_0>(xd, m, w, k, buf, state, out); break;
    case Q4_1: wide_group_of<Q4_1>(xd, m, w, k, buf, state, out); break;
    default: wide_group_of<Q4_0>(xd, m, w, k, buf, state, out); break;
  }
}
#define EYAS_GGUF_F32_WIDE 1

// decode_attention.cpp's AVX-512 path (head_dim 64 or 128: a row is 4 or 8 registers), which every pool dtype takes
// on an AVX-512 build but bfloat16 queries over bfloat16 pages where AVX512_BF16 is built (decode_attention_bf16.h,
// which uses its softmax helpers). Included by decode_attention.cpp inside its anonymous namespace, after Rows,
// row_scale and the exp constants.
#pragma once

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bfloat16 -> float32 is exact: the 16 bits become the high half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p) {  // exact: |x| <= 127; the group's scale is applied by load_row
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// A stored row of D = 16 * C values as C float32 registers. An int8 register lies in one scale group: it is
// multiplied by its group's float16 scale, at byte D + 2 (16 c / G) of the row; those offsets are worked out once
// per call (ScaleOffsets). Both alternatives tried measured slower on Zen 4 (benchmarks/RESULTS.md, issue 40): a
// division by the runtime G per register, and widening a row's scales together (one F16C conversion) then a lane
// permute per register.
template <int C>
struct ScaleOffsets {
  std::array<int64_t, C> at;
  explicit ScaleOffsets(int64_t G) {
    for (int c = 0; c < C; c++) at[c] = 16 * C + 2 * (16 * c / G);
  }
};

template <int C, typename T>
inline void load_row(const T* row, const ScaleOffsets<C>& scales, __m512 (&out)[C]) {
  for (int c = 0; c < C; c++) {
    if constexpr (std::is_same_v<T, int8_t>) {
      uint16_t bits;
      std::memcpy(&bits, row + scales.at[c], sizeof(bits));
      out[c] = _mm512_mul_ps(load16(row + 16 * c), _mm512_set1_ps(_cvtsh_ss(bits)));
    } else {
      out[c] = load16(row + 16 * c);
    }
  }
}

// exp(x) for the softmax's x <= 0: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, degree-6 Taylor polynomial
// (relative error < 2e-7); scalef makes 2^n exactly and flushes x < -104 to 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(p, n);
}

// The 4 sums of 4 vectors: lane h of the result is the sum of the lanes of vector h.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Per 128-bit lane: ab = [a0+a2, b0+b2, a1+a3, b1+b3], then [a, b, c, d] partials; then the 4 lanes added.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

// The 4 lanes' (heads') max and sum over the four 128-bit lanes of v, broadcast back to all four.
inline __m512 lanes_max(__m512 v) {
  const __m512 x = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));  // swap 256-bit halves
  return _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));             // swap 128-bit lanes within them
}
inline __m512 lanes_sum(__m512 v) {
  const __m512 x = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  return _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
}

// The lane-wise max of the n floats at s (the tail's missing lanes -inf).
inline __m512 max_lanes(const float* s, int64_t n) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  __m512 mv = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
  if (tail) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, tail, s + i));
  return mv;
}

// In place s[i] = exp(s[i] - m) over the n floats at s (m lane i % 16); returns their lane-wise sums.
inline __m512 exp_lanes(float* s, int64_t n, __m512 m) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  __m512 zv = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
    _mm512_storeu_ps(s + i, e);
    zv = _mm512_add_ps(zv, e);
  }
  if (tail) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), m));
    _mm512_mask_storeu_ps(s + i, tail, e);
    zv = _mm512_add_ps(zv, _mm512_maskz_mov_ps(tail, e));
  }
  return zv;
}

// Scores s[t * 4 + h] of 4 heads: in place exp(s - max over t) per head; returns 4 x (1 / sum), as 16 lanes.
inline __m512 softmax4(float* s, int64_t L) {
  const __m512 zv = exp_lanes(s, 4 * L, lanes_max(max_lanes(s, 4 * L)));
  return _mm512_div_ps(_mm512_set1_ps(1.f), lanes_sum(zv));
}

// NG <= 4 query heads (a block of one kv head's group), head_dim = 16 * C; s holds 4 * L floats (the scores of 4
// heads side by side, so one shuffle tree reduces 4 dot products at once; heads NG.. are zeros). Same arguments as
// attend_plain.
template <int C, int NG, typename T>
void attend_block(const float* q, const Rows<T>& k, const Rows<T>& v, float* s, float* out) {
  constexpr int D = 16 * C;
  __m512 qv[NG][C];
  for (int h = 0; h < NG; h++)
    for (int c = 0; c < C; c++) qv[h][c] = _mm512_loadu_ps(q + h * D + 16 * c);
  const ScaleOffsets<C> k_sel(k.group), v_sel(v.group);
  k.each([&](int64_t t, const T* kr) {
    __m512 kv[C];
    load_row<C>(kr, k_sel, kv);
    __m512 dot[4];
    for (int h = 0; h < 4; h++) {
      dot[h] = _mm512_setzero_ps();
      if (h < NG)
        for (int c = 0; c < C; c++) dot[h] = _mm512_fmadd_ps(qv[h][c], kv[c], dot[h]);
    }
    _mm_storeu_ps(s + 4 * t, hsum4(dot[0], dot[1], dot[2], dot[3]));
  });
  float inv[16];
  _mm512_storeu_ps(inv, softmax4(s, k.len));
  __m512 acc[NG][C];
  for (int h = 0; h < NG; h++)
    for (int c = 0; c < C; c++) acc[h][c] = _mm512_setzero_ps();
  v.each([&](int64_t t, const T* vr) {
    __m512 vv[C];
    load_row<C>(vr, v_sel, vv);
    for (int h = 0; h < NG; h++) {
      const __m512 p = _mm512_set1_ps(s[4 * t + h]);
      for (int c = 0; c < C; c++) acc[h][c] = _mm512_fmadd_ps(p, vv[c], acc[h][c]);
    }
  });
  for (int h = 0; h < NG; h++)
    for (int c = 0; c < C; c++)
      _mm512_storeu_ps(out + h * D + 16 * c, _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv[h])));
}

// Heads in blocks of at most 16 / C registers' worth (4 for head_dim 64, 2 for 128).
template <int C, typename T>
void attend_heads(const float* q, int64_t g, const Rows<T>& k, const Rows<T>& v, float* s, float* out) {
  head_blocks<C <= 4 ? 4 : 2>(g, [&](auto n, int64_t h0) {
    attend_block<C, decltype(n)::value>(q + h0 * 16 * C, k, v, s, out + h0 * 16 * C);
  });
}

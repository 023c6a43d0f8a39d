// decode_attention.cpp's path for CPUs with AVX2 and FMA but no AVX-512 (the AVX2 kind, and AVX-512 CPUs built for
// it): the same two passes as its AVX-512 path, in 8-lane registers. Included by decode_attention.cpp inside its
// anonymous namespace, after Rows, row_scale and the exp constants. Why its own path: the plain C++ one (dot8,
// std::exp, a scalar weighted sum) took 0.6 ms a decode step at 30 tokens of context and 1.6 ms at 160 (24 layers
// of 14 x 64 heads, AVX2 build), where the AVX-512 path takes ~0.2.
//
// Register budget (16 ymm): a key row of head_dim 64 is 8 registers, so the score pass reads the query heads from
// L1 rather than holding them, and the value pass takes 16 columns (2 registers) of the block's heads at a time,
// going over the keys once per 16 columns (the rows stay in L1/L2 between the goes).
#pragma once

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // exact: the 16 bits become the float's high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {  // exact: |x| <= 127; the group's scale is applied by load8_scaled
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Columns 8 c .. 8 c + 7 of a stored row of D values as float32; int8 rows times their group's float16 scale (a
// group is a multiple of 16 columns, so 8 never straddle two).
template <typename T>
inline __m256 load8_scaled(const T* row, int64_t D, int64_t G, int64_t c) {
  if constexpr (std::is_same_v<T, int8_t>)
    return _mm256_mul_ps(load8(row + 8 * c), _mm256_set1_ps(row_scale(row, D, G, 8 * c)));
  else
    return load8(row + 8 * c);
}

// exp(x) for the softmax's x <= 0: 2^n * p(r) as exp16 in decode_attention.cpp (its constants), 2^n made in the
// exponent bits (no scalef in AVX2), so x < -87 (2^n below float's normal range) is flushed to 0.
inline __m256 exp8(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

// Lane h of the result: the sum of the 8 lanes of vector h.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128-bit half: a, b, c, d
  return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

// Scores s[t * 4 + h] of 4 heads (4 L floats): in place exp(s - max over t) per head; returns 1 / sum per head.
inline __m128 softmax4(float* s, int64_t L) {
  const int64_t n = 4 * L, whole = n / 8 * 8;  // a register holds two keys; an odd L leaves one key (4 floats)
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < whole; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  if (whole < n) m4 = _mm_max_ps(m4, _mm_loadu_ps(s + whole));
  const __m256 m = _mm256_set_m128(m4, m4);
  __m256 zv = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
    _mm256_storeu_ps(s + i, e);
    zv = _mm256_add_ps(zv, e);
  }
  __m128 z4 = _mm_add_ps(_mm256_castps256_ps128(zv), _mm256_extractf128_ps(zv, 1));
  if (whole < n) {
    const __m128 e = _mm256_castps256_ps128(exp8(_mm256_castps128_ps256(_mm_sub_ps(_mm_loadu_ps(s + whole), m4))));
    _mm_storeu_ps(s + whole, e);
    z4 = _mm_add_ps(z4, e);
  }
  return _mm_div_ps(_mm_set1_ps(1.f), z4);
}

// NG <= 4 query heads of one kv head's group, head_dim D = 8 C; s holds 4 L floats (heads NG.. score zeros). Same
// arguments as attend_plain.
template <int C, int NG, typename T>
void attend_block(const float* q, const Rows<T>& k, const Rows<T>& v, float* s, float* out) {
  constexpr int D = 8 * C;
  k.each([&](int64_t t, const T* kr) {
    __m256 dot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int c = 0; c < C; c++) {
      const __m256 kc = load8_scaled(kr, D, k.group, c);
      for (int h = 0; h < NG; h++) dot[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + 8 * c), kc, dot[h]);
    }
    _mm_storeu_ps(s + 4 * t, hsum4(dot[0], dot[1], dot[2], dot[3]));
  });
  float inv[4];
  _mm_storeu_ps(inv, softmax4(s, k.len));
  for (int c0 = 0; c0 < C; c0 += 2) {
    __m256 acc[NG][2];
    for (int h = 0; h < NG; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    v.each([&](int64_t t, const T* vr) {
      const __m256 v0 = load8_scaled(vr, D, v.group, c0), v1 = load8_scaled(vr, D, v.group, c0 + 1);
      for (int h = 0; h < NG; h++) {
        const __m256 p = _mm256_broadcast_ss(s + 4 * t + h);
        acc[h][0] = _mm256_fmadd_ps(p, v0, acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(p, v1, acc[h][1]);
      }
    });
    for (int h = 0; h < NG; h++)
      for (int i = 0; i < 2; i++)
        _mm256_storeu_ps(out + h * D + 8 * (c0 + i), _mm256_mul_ps(acc[h][i], _mm256_set1_ps(inv[h])));
  }
}

// Heads in blocks of at most 4.
template <int C, typename T>
void attend_heads(const float* q, int64_t g, const Rows<T>& k, const Rows<T>& v, float* s, float* out) {
  head_blocks<4>(g, [&](auto n, int64_t h0) {
    attend_block<C, decltype(n)::value>(q + h0 * 8 * C, k, v, s, out + h0 * 8 * C);
  });
}

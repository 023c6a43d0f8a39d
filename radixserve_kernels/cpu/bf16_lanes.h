// Vectors of float32 or bfloat16 values as float lanes, for the fused elementwise ops (silu_mul.cpp,
// norm_rope.cpp): loads widen exactly, stores round as torch's vectorized ops do (to nearest even, NaN as 0xffff),
// and round_to(T*, v) gives the float a T result holds. kLanes: 16 on AVX-512, 8 on AVX2; a build with neither gets
// none of these (its callers keep their scalar loops).
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace radixserve::cpu::lanes {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline __m512 splat(float v) { return _mm512_set1_ps(v); }
inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// torch's vectorized float -> bfloat16 (vec512_bfloat16.h cvtfp32_bf16): to nearest even, NaN as 0xffff.
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bias, bits), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), rounded);
}
inline __m512 round_to(float*, __m512 v) { return v; }
inline __m512 round_to(at::BFloat16*, __m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtusepi32_epi16(bf16_bits(v)));
}
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline __m256 splat(float v) { return _mm256_set1_ps(v); }
inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// torch's vectorized float -> bfloat16 (vec256_bfloat16.h cvtfp32_bf16): to nearest even, NaN as 0xffff.
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bias, bits), 16);
  const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
  return _mm256_blendv_epi8(_mm256_set1_epi32(0xffff), rounded, ordered);
}
inline __m256 round_to(float*, __m256 v) { return v; }
inline __m256 round_to(at::BFloat16*, __m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store(at::BFloat16* p, __m256 v) {  // the eight 16-bit values, packed within each half, then the halves
  const __m256i packed = _mm256_packus_epi32(bf16_bits(v), bf16_bits(v));
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}
#endif

}  // namespace radixserve::cpu::lanes

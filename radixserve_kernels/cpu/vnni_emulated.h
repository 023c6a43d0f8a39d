// Tests only (RADIXSERVE_CPU_EMULATE_VNNI=1, radixserve_kernels/cpu/__init__.py): the GGUF kernels' AVX-512 VNNI path
// built for a CPU without AVX-512, every AVX-512 intrinsic taken from SIMDe (a software emulation: slower, the same
// results), so that a machine without AVX-512 checks that path's results too (tests/test_gguf_kernels.py).
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

#include <cstdint>

// What SIMDe 0.7 lacks (or aliases wrongly), lane by lane as the instructions define them. The reductions add (or
// take the max) in the order GCC's avx512fintrin.h does (halves of 256, of 128, then pairs), which a native build of
// these kernels runs.
namespace radixserve::emulated {

// Lane i of the result: Out(lane i of v) (a static_cast: sign or zero extension, or truncation), v holding N values
// of In; `put` stores v, `get` loads the result.
template <typename In, typename Out, int N, typename V, typename Put, typename Get>
inline auto convert(V v, Put put, Get get) {
  In in[N];
  Out out[N];
  put(in, v);
  for (int i = 0; i < N; i++) out[i] = static_cast<Out>(in[i]);
  return get(out);
}
inline void put128(void* p, simde__m128i v) { simde_mm_storeu_si128(p, v); }
inline void put256(void* p, simde__m256i v) { simde_mm256_storeu_si256(p, v); }
inline void put512(void* p, simde__m512i v) { simde_mm512_storeu_si512(p, v); }
inline simde__m128i get128(const void* p) { return simde_mm_loadu_si128(p); }
inline simde__m512i get512(const void* p) { return simde_mm512_loadu_si512(p); }

inline simde__m256 high_ps(simde__m512 v) {
  return simde_mm256_castpd_ps(simde_mm512_extractf64x4_pd(simde_mm512_castps_pd(v), 1));
}
// _mm512_cvtepi32_ps and _mm512_cvtps_epi32: each half by AVX's conversion (the same rounding, to nearest even).
inline simde__m512 to_ps(simde__m512i v) {
  const simde__m256 lo = simde_mm256_cvtepi32_ps(simde_mm512_castsi512_si256(v));
  const simde__m256 hi = simde_mm256_cvtepi32_ps(simde_mm512_extracti64x4_epi64(v, 1));
  return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(lo), hi, 1);
}
inline simde__m512i to_epi32(simde__m512 v) {
  const simde__m256i lo = simde_mm256_cvtps_epi32(simde_mm512_castps512_ps256(v));
  const simde__m256i hi = simde_mm256_cvtps_epi32(high_ps(v));
  return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(lo), hi, 1);
}
inline simde__m512i mask_srli_epi16(simde__m512i src, uint32_t k, simde__m512i a, int imm) {
  uint16_t s[32], x[32];
  simde_mm512_storeu_si512(s, src);
  simde_mm512_storeu_si512(x, a);
  for (int i = 0; i < 32; i++)
    if (k >> i & 1) s[i] = imm > 15 ? 0 : static_cast<uint16_t>(x[i] >> imm);
  return simde_mm512_loadu_si512(s);
}
// _mm512_shuffle_epi32: lane i takes lane 4 (i / 4) + (bits 2 (i % 4) .. of imm) of a (within its 128-bit block).
inline simde__m512i shuffle_epi32(simde__m512i a, int imm) {
  uint32_t x[16], r[16];
  simde_mm512_storeu_si512(x, a);
  for (int i = 0; i < 16; i++) r[i] = x[(i & ~3) + (imm >> (2 * (i & 3)) & 3)];
  return simde_mm512_loadu_si512(r);
}
// _mm512_cvtph_ps: each half by F16C's conversion (exact: every fp16 value is a float).
inline simde__m512 cvtph_ps(simde__m256i v) {
  const simde__m256 lo = simde_mm256_cvtph_ps(simde_mm256_castsi256_si128(v));
  const simde__m256 hi = simde_mm256_cvtph_ps(simde_mm256_extracti128_si256(v, 1));
  return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(lo), hi, 1);
}
template <typename Op>
inline float reduce_ps(simde__m512 v, Op op) {
  float a[16], t3[8], t6[4];
  simde_mm512_storeu_ps(a, v);
  for (int i = 0; i < 8; i++) t3[i] = op(a[8 + i], a[i]);
  for (int i = 0; i < 4; i++) t6[i] = op(t3[4 + i], t3[i]);
  const float t8[2] = {op(t6[0], t6[2]), op(t6[1], t6[3])};
  return op(t8[0], t8[1]);
}

}  // namespace radixserve::emulated

// Newer SIMDe versions may alias some of these themselves: ours replace theirs.
#undef _mm512_cvtepi32_ps
#undef _mm512_cvtps_epi32
#undef _mm512_cvtepi8_epi32
#undef _mm512_cvtepu8_epi32
#undef _mm512_cvtepu16_epi32
#undef _mm512_cvtepi32_epi8
#undef _mm512_mask_srli_epi16
#undef _mm512_reduce_add_ps
#undef _mm512_reduce_max_ps
#undef _cvtu64_mask64
#undef _mm512_shuffle_epi32
#undef _mm512_cvtph_ps
#undef _mm512_madd_epi16  // SIMDe 0.7's alias takes the masked form's four arguments
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
#define _mm512_cvtepi32_ps(v) radixserve::emulated::to_ps(v)
#define _mm512_cvtps_epi32(v) radixserve::emulated::to_epi32(v)
#define _mm512_cvtepi8_epi32(v) \
  radixserve::emulated::convert<int8_t, int32_t, 16>(v, radixserve::emulated::put128, radixserve::emulated::get512)
#define _mm512_cvtepu8_epi32(v) \
  radixserve::emulated::convert<uint8_t, int32_t, 16>(v, radixserve::emulated::put128, radixserve::emulated::get512)
#define _mm512_cvtepu16_epi32(v) \
  radixserve::emulated::convert<uint16_t, int32_t, 16>(v, radixserve::emulated::put256, radixserve::emulated::get512)
#define _mm512_cvtepi32_epi8(v) \
  radixserve::emulated::convert<int32_t, int8_t, 16>(v, radixserve::emulated::put512, radixserve::emulated::get128)
#define _mm512_shuffle_epi32(a, imm) radixserve::emulated::shuffle_epi32(a, static_cast<int>(imm))
#define _mm512_cvtph_ps(v) radixserve::emulated::cvtph_ps(v)
#define _mm512_mask_srli_epi16(src, k, a, imm) radixserve::emulated::mask_srli_epi16(src, k, a, imm)
#define _mm512_reduce_add_ps(v) radixserve::emulated::reduce_ps(v, [](float x, float y) { return x + y; })
#define _mm512_reduce_max_ps(v) radixserve::emulated::reduce_ps(v, [](float x, float y) { return x > y ? x : y; })
#define _cvtu64_mask64(m) static_cast<simde__mmask64>(m)

// A 16 x 16 transpose of 32-bit words in AVX-512 registers, shared by the GGUF tiles (gguf_tiles.h: 16 weight rows'
// codes side by side) and the bfloat16 attention path (decode_attention_bf16.h: 16 keys' value pairs side by side).
// The includer brings the intrinsics first: <immintrin.h>, or SIMDe's through vnni_emulated.h in the emulated build.
#pragma once

#include <cstdint>

namespace radixserve::simd {

// out[16 j + i] = the 32-bit word j of the 64 bytes at rows[i] + offset (bytes).
inline void transpose16(const void* const* rows, int64_t offset, void* out) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(static_cast<const uint8_t*>(rows[i]) + offset);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int k = 0; k < 16; k += 4) {  // r[k + j]: in 128-bit lane L, word 4 L + j of rows k .. k + 3
    r[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
    r[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
    r[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
    r[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  __m512i* o = static_cast<__m512i*>(out);
  for (int j = 0; j < 4; j++) {  // lane L of r[j], r[4 + j], r[8 + j], r[12 + j] -> word 4 L + j
    const __m512i ab_lo = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
    const __m512i ab_hi = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i cd_hi = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    _mm512_storeu_si512(o + j, _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88));
    _mm512_storeu_si512(o + 4 + j, _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD));
    _mm512_storeu_si512(o + 8 + j, _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88));
    _mm512_storeu_si512(o + 12 + j, _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD));
  }
}

}  // namespace radixserve::simd

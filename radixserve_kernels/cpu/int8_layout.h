// The packed layout of int8 codes shared by int8_linear.cpp (decode) and int8_dense.cpp (prefill, widening):
// uint8 (q + 128) in [N/8][K/64][8][64] (radixserve/model/quant.py, pack_int8).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace radixserve::int8 {

constexpr int64_t kRows = 8;
constexpr int64_t kCols = 64;

inline void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(2) == kRows &&
                  packed.size(3) == kCols && packed.is_contiguous(),
              "int8 codes must be packed uint8 [N/8, K/64, 8, 64] (radixserve.model.quant.pack_int8)");
}

// 64 codes -> 64 values of T (int8 values are exact in float32 and bfloat16).
template <typename T>
inline void widen64(const uint8_t* src, T* dst) {
  for (int64_t j = 0; j < kCols; j++) dst[j] = static_cast<T>(static_cast<float>(static_cast<int>(src[j]) - 128));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 widen16(const uint8_t* src) {
  const __m128i q = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)), _mm_set1_epi8(-128));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}

template <>
inline void widen64<float>(const uint8_t* src, float* dst) {
  for (int j = 0; j < kCols; j += 16) _mm512_storeu_ps(dst + j, widen16(src + j));
}

template <>
inline void widen64<at::BFloat16>(const uint8_t* src, at::BFloat16* dst) {
  for (int j = 0; j < kCols; j += 16) {  // a small integer's float has 16 zero low bits: its bf16 is the high half
    const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(widen16(src + j)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm512_cvtepi32_epi16(bits));
  }
}
#endif

template <typename T>
inline void unpack_into(const uint8_t* w, int64_t NB, int64_t K, T* out) {
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)
      for (int64_t c = 0; c < K / kCols; c++)
        for (int64_t i = 0; i < kRows; i++)
          widen64(w + ((b * (K / kCols) + c) * kRows + i) * kCols, out + (b * kRows + i) * K + c * kCols);
  });
}

}  // namespace radixserve::int8

// The activations of a GGUF linear (gguf_linear.cpp), rounded as ggml rounds them for its q8_0 dot products: int8
// codes per block of 32 with a float scale, plus the per-row sums the dot products need to take out the weights'
// zero points (integer, per vpdpbusd lane) or offsets (float, per 16 columns). Every ISA path reads the same
// rounding, done here (a small share of a step: M x K values against N x K weights, but on the calling thread alone,
// before the pool starts).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"

namespace radixserve::gguf {

constexpr int64_t kXBlock = 32;  // activations per int8 scale (ggml's q8_0 block)
constexpr int64_t kChunk = 64;   // columns per vpdpbusd: 16 int32 lanes of 4 bytes

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The activations as the dot products read them. K64: K padded to 64 with zero codes; S: per-16 entries padded to
// a multiple of 16 (zero), so the offset term's loop has no tail.
struct QuantX {
  int64_t K64, S;
  std::vector<int8_t> q;       // [M][K64]
  std::vector<float> lane;     // [M][K64 / 4]: the scale of the block each group of 4 codes belongs to
  std::vector<float> scale16;  // [M][S]: the scale per 16 columns
  std::vector<float> corr;     // [M][S]: scale * (sum of the 16 codes), what the offsets b multiply
  std::vector<int32_t> nsum4;  // [M][K64 / 4]: minus the sum of each group of 4 codes (a vpdpbusd lane)
};

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }  // exact

// ggml's q8_0 rounding: q = nearest-even(x * (127 / absmax)), scale = absmax / 127 (0 for an all-zero block).
// With AVX-512 the same operations run 16 lanes at a time (the absmax, a max, does not depend on order; products
// and rounding are per value), so every build gives the same codes.
template <typename In>
inline void quantize_block(const In* x, int8_t* q, float& scale) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 v[2];
  for (int h = 0; h < 2; h++) {
    if constexpr (std::is_same_v<In, float>) {
      v[h] = _mm512_loadu_ps(x + 16 * h);
    } else {  // bfloat16 bits are the float's top half
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * h));
      v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    }
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  scale = amax / 127.f;
  for (int h = 0; h < 2; h++) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
  }
#else
  float amax = 0.f;
  for (int j = 0; j < kXBlock; j++) amax = std::max(amax, std::fabs(widen(x[j])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  scale = amax / 127.f;
  for (int j = 0; j < kXBlock; j++)
    q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(widen(x[j]) * inv), -127.f, 127.f));
#endif
}

template <typename In>
inline QuantX quantize_rows(const In* x, int64_t M, int64_t K) {
  QuantX xq{round_up(K, kChunk), round_up(round_up(K, kChunk) / kSub, 16), {}, {}, {}, {}, {}};
  xq.nsum4.assign(M * xq.K64 / 4, 0);
  xq.q.assign(M * xq.K64, 0);
  xq.lane.assign(M * xq.K64 / 4, 0.f);
  xq.scale16.assign(M * xq.S, 0.f);
  xq.corr.assign(M * xq.S, 0.f);
  for (int64_t m = 0; m < M; m++) {
    int8_t* q = xq.q.data() + m * xq.K64;
    for (int64_t blk = 0; blk < K / kXBlock; blk++) {
      float s;
      quantize_block(x + m * K + blk * kXBlock, q + blk * kXBlock, s);
      std::fill_n(xq.lane.data() + m * xq.K64 / 4 + blk * 8, 8, s);
      for (int h = 0; h < 2; h++) {
        int sum = 0;
        for (int j = 0; j < 16; j++) sum += q[blk * kXBlock + h * 16 + j];
        xq.scale16[m * xq.S + blk * 2 + h] = s;
        xq.corr[m * xq.S + blk * 2 + h] = s * static_cast<float>(sum);
      }
    }
    for (int64_t g = 0; g < K / 4; g++) xq.nsum4[m * xq.K64 / 4 + g] = -(q[4 * g] + q[4 * g + 1] + q[4 * g + 2] + q[4 * g + 3]);
  }
  return xq;
}

}  // namespace radixserve::gguf

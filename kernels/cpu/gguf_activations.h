// The activations of a GGUF linear (gguf_linear.cpp), rounded as ggml rounds them for its q8_0 dot products: int8
// codes per block of 32 with a float scale, plus the per-row sums the dot products need to take out the weights'
// zero points (integer, per vpdpbusd lane) or offsets (float, per 16 columns). Every ISA path reads the same
// rounding, done here in plain C++ (a small share of a step: M x K values against N x K weights).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

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

// ggml's q8_0 rounding: q = nearest-even(x * (127 / absmax)), scale = absmax / 127 (0 for an all-zero block).
inline void quantize_block(const float* x, int8_t* q, float& scale) {
  float amax = 0.f;
  for (int j = 0; j < kXBlock; j++) amax = std::max(amax, std::fabs(x[j]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  scale = amax / 127.f;
  for (int j = 0; j < kXBlock; j++) q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(x[j] * inv), -127.f, 127.f));
}

inline QuantX quantize_rows(const float* x, int64_t M, int64_t K) {
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

// The activations of a GGUF linear (gguf_linear.cpp), rounded as ggml rounds them for its q8_0 dot products: int8
// codes per block of 32 with a float scale, plus the per-row sums the dot products need to take out the weights'
// zero points (integer, per vpdpbusd lane) or offsets (float, per 16 columns). Every ISA path reads the same
// rounding, done here (a small share of a step: M x K values against N x K weights; a decode step's few rows on the
// calling thread, a prefill's on the pool's threads).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gguf_blocks.h"
#include "spin_pool.h"
#include "with_count.h"

namespace radixserve::gguf {

constexpr int64_t kXBlock = 32;  // activations per int8 scale (ggml's q8_0 block)
constexpr int64_t kChunk = 64;   // columns per vpdpbusd: 16 int32 lanes of 4 bytes

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The activations as the dot products read them. K64: K padded to 64 with zero codes; S: per-16 entries padded to
// a multiple of 16 (zero), so the offset term's loop has no tail.
struct QuantX {
  int64_t K64, S;
  std::vector<int8_t> q;       // [M][K64]
  std::vector<float> lane;     // [M][K64 / 4]: the scale of the block each group of 4 codes belongs to (VNNI only)
  std::vector<float> scale16;  // [M][S]: the scale per 16 columns
  std::vector<float> corr;     // [M][S]: scale * (sum of the 16 codes), what the offsets b multiply
  // zero_lane[s]: [M][K64 / 4], one per group of 4 codes (a vpdpbusd lane): minus the sum of the 16 codes (the
  // sub-block) the group belongs to, times 2^s: where the VNNI decode rows of Q6_K (zero point 2^s) start each lane
  // (gguf_decode.h). Stored shifted, a decode row's load is all it takes (a shift per activation row and chunk was
  // ~5% of a pass's operations). Filled only where the call needs it (VNNI builds; else empty), as the three below.
  std::array<std::vector<int32_t>, 8> zero_lane;
  // The 32-weight formats' VNNI decode rows (gguf_decode32.h), per 128 columns (K128: K padded with zero codes):
  int64_t K128 = 0;
  std::vector<int8_t> q128;  // [M][K128]: each 128 codes as the 16-code first halves of its four blocks, then the second
  std::vector<float> lane32;  // [M][K128 / 8]: per 128 columns, lane 4 j + p (p < 4): the scale of block j
  std::array<std::vector<int32_t>, 8> zero32;  // [s][M][K128 / 8]: lane 4 j + p: minus block j's code sum, times 2^s
  std::vector<int32_t> nsum16;  // [M][S]: minus the sum of each 16 codes (a sub-block)
  std::vector<int32_t> nsum32;  // [M][K64 / 32]: minus the sum of each 32 codes (AVX2's whole-chunk step; VNNI's Q4_0, Q5_0, Q8_0)
  // Rounded per 256 columns instead (kRound256 builds, for linears with K-quant parts; else empty):
  std::vector<int8_t> q256;     // [M][K64]
  std::vector<float> d256;      // [M][K64 / 256]: the scale of each 256 columns
  std::vector<int16_t> sum16;   // [M][K64 / 16]: the sum of each 16 of q256's codes
};

// Whether this build's K-quants (Q4_K, Q5_K, Q6_K) read the activations rounded per super-block (QuantX.q256, as
// ggml's q8_K): the AVX2 decode, which then sums a super-block in integers (gguf_kquants_avx2.h). VNNI and plain C++
// read q.
#if defined(__AVX2__) && defined(__FMA__) && !defined(RADIXSERVE_GGUF_VNNI)
constexpr bool kRound256 = true;
#else
constexpr bool kRound256 = false;
#endif
inline bool rounds_per_256(int64_t type) { return kRound256 && (type == kQ4_K || type == kQ5_K || type == kQ6_K); }

// Whether this build reads QuantX.lane (the VNNI decode rows, gguf_decode.h); other builds leave it empty.
#if defined(RADIXSERVE_GGUF_VNNI)
constexpr bool kVnniLanes = true;
#else
constexpr bool kVnniLanes = false;
#endif

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }  // exact

#if defined(RADIXSERVE_GGUF_AVX512)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {  // bfloat16 bits are the float's top half
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
#elif defined(__AVX2__)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
#endif

// ggml's q8_0 rounding: q = nearest-even(x * (127 / absmax)), scale = absmax / 127 (0 for an all-zero block).
// With AVX-512 the same operations run 16 lanes at a time (the absmax, a max, does not depend on order; products
// and rounding are per value), so every build gives the same codes. In two steps, so that the K-quants' rounding
// per 256 columns (quantize_block256) shares them.
template <typename In>
inline float absmax32(const In* x) {
#if defined(RADIXSERVE_GGUF_AVX512)
  __m512 v[2];
  for (int h = 0; h < 2; h++) v[h] = load16(x + 16 * h);
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m8 = _mm256_andnot_ps(sign, load8(x));
  for (int h = 1; h < 4; h++) m8 = _mm256_max_ps(m8, _mm256_andnot_ps(sign, load8(x + 8 * h)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
  float amax = 0.f;
  for (int j = 0; j < kXBlock; j++) amax = std::max(amax, std::fabs(widen(x[j])));
  return amax;
#endif
}

// q[j] = nearest-even(x[j] * inv) clamped to +-127, for 32 values.
template <typename In>
inline void round32(const In* x, float inv, int8_t* q) {
#if defined(RADIXSERVE_GGUF_AVX512)
  for (int h = 0; h < 2; h++) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load16(x + 16 * h), _mm512_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
  }
#elif defined(__AVX2__)
  // The same operations 8 lanes at a time (with the scalar loop below, rounding and sums together, the AVX2 build's
  // 512-row linears took 4-8% longer: benchmarks.gguf_linear, RESULTS.md issue 38 session 15).
  __m256i c[4];
  for (int h = 0; h < 4; h++) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(load8(x + 8 * h), _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c[h] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f)));
  }
  // Packing works per 128-bit half: the 4-byte groups come out as 0-3 of each register, then 4-7; put them back.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  for (int j = 0; j < kXBlock; j++) q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(widen(x[j]) * inv), -127.f, 127.f));
#endif
}

template <typename In>
inline void quantize_block(const In* x, int8_t* q, float& scale) {
  const float amax = absmax32(x);
  scale = amax / 127.f;
  round32(x, amax > 0.f ? 127.f / amax : 0.f, q);
}

// The same rounding over a K-quant super-block (256 columns, one scale), as ggml's q8_K rounds the activations of
// its K-quant dot products: the AVX2 decode of the K-quants sums a whole super-block in integers before its float
// step (gguf_decode_avx2.h).
template <typename In>
inline void quantize_block256(const In* x, int8_t* q, float& scale) {
  float amax = 0.f;
  for (int b = 0; b < 8; b++) amax = std::max(amax, absmax32(x + kXBlock * b));
  scale = amax / 127.f;
  for (int b = 0; b < 8; b++) round32(x + kXBlock * b, amax > 0.f ? 127.f / amax : 0.f, q + kXBlock * b);
}

// nsum[g] = -(q[4 g] + .. + q[4 g + 3]) for g < K / 4 (K a multiple of 32): vpmaddubsw by ones adds pairs, vpmaddwd
// by ones the pairs' pairs, exact.
inline void minus_lane_sums(const int8_t* q, int64_t K, int32_t* nsum) {
  int64_t k = 0;
#if defined(RADIXSERVE_GGUF_AVX512)
  for (; k + 64 <= K; k += 64) {
    const __m512i p = _mm512_maddubs_epi16(_mm512_set1_epi8(1), _mm512_loadu_si512(q + k));
    _mm512_storeu_si512(nsum + k / 4, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_madd_epi16(p, _mm512_set1_epi16(1))));
  }
#endif
#if defined(__AVX2__)
  for (; k + 32 <= K; k += 32) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(nsum + k / 4),
                        _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(p, _mm256_set1_epi16(1))));
  }
#endif
  for (; k < K; k += 4) nsum[k / 4] = -(q[k] + q[k + 1] + q[k + 2] + q[k + 3]);
}

// Rows from this many on are rounded on the pool's threads (a 512-row prefill step at K = 4864 took ~2 ms a linear
// on the calling thread alone); a decode step's few rows are not worth waking them.
constexpr int64_t kParallelRows = 32;

// Row m's codes per 256 columns into xq (K a multiple of 256).
template <typename In>
inline void quantize_row256(const In* x, int64_t K, QuantX& xq, int64_t m) {
  int8_t* q = xq.q256.data() + m * xq.K64;
  for (int64_t blk = 0; blk < K / 256; blk++) quantize_block256(x + blk * 256, q + blk * 256, xq.d256[m * xq.K64 / 256 + blk]);
  int16_t* sum16 = xq.sum16.data() + m * xq.K64 / kSub;
  for (int64_t c = 0; c < K / kXBlock; c++) {  // each 32 codes' eight lane sums, then the two 16-column halves
    int32_t nsum[8];
    minus_lane_sums(q + c * kXBlock, kXBlock, nsum);
    sum16[2 * c] = static_cast<int16_t>(-(nsum[0] + nsum[1] + nsum[2] + nsum[3]));
    sum16[2 * c + 1] = static_cast<int16_t>(-(nsum[4] + nsum[5] + nsum[6] + nsum[7]));
  }
}

// What the call's VNNI decode rows read besides the codes (gguf_linear.cpp fills it from the formats it decodes).
struct DecodeNeeds {
  unsigned zero16 = 0;  // bit s: zero_lane[s] (Q6_K)
  unsigned zero32 = 0;  // bit s: zero32[s] (the 32-weight formats), with q128 and lane32 when any is set
};

// Block b's (< K / 32) entries of q128, lane32 and zero32 for row m, from its codes q (K64) and sums nsum32.
inline void fill_block32(const int8_t* q, const int32_t* nsum32, const float* scale16, int64_t K, unsigned zero32,
                         int64_t m, QuantX& xq) {
  int8_t* q2 = xq.q128.data() + m * xq.K128;
  for (int64_t b = 0; b < K / kXBlock; b++) {
    const int64_t c = b / 4, j = b % 4, at = m * xq.K128 / 8 + 16 * c + 4 * j;
    std::memcpy(q2 + 128 * c + 16 * j, q + kXBlock * b, 16);
    std::memcpy(q2 + 128 * c + 64 + 16 * j, q + kXBlock * b + 16, 16);
    std::fill_n(xq.lane32.data() + at, 4, scale16[2 * b]);
    for (int sh = 0; sh < 8; sh++)
      if (zero32 >> sh & 1) std::fill_n(xq.zero32[sh].data() + at, 4, nsum32[b] * (1 << sh));
  }
}

// v with at least n entries. Never shrunk between calls: a vector that shrinks zeroes its entries again when it
// grows back, and a decode step's linears alternate K = 896 and 4864.
template <typename T>
inline T* at_least(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// v as `rows` rows of row_len entries whose entries from `written` on (the padding past K) are zero; the rest is
// left as it was, for quantize_rows to overwrite. Zeroing every buffer whole was a memset of 0.3-1.4 ms of each
// eight-row decode step on the calling thread (perf); the writes now make the first touch of those lines instead,
// so the calling thread's time came out level (RESULTS.md, issue 38 session 50).
template <typename T>
inline void rows_zero_tail(std::vector<T>& v, int64_t rows, int64_t row_len, int64_t written) {
  T* p = at_least(v, rows * row_len);
  if (written < row_len)
    for (int64_t m = 0; m < rows; m++) std::fill(p + m * row_len + written, p + (m + 1) * row_len, T{});
}

// The rows of x rounded into xq, whose buffers are reused from call to call (each linear allocated and freed ten:
// malloc and free were 1.6% of the calling thread's samples in a decode, RESULTS.md issue 38 session 30); every
// entry a kernel reads is rewritten (the padding past K zeroed, rows_zero_tail). `per256`: also the codes per 256
// columns (a linear with parts that rounds_per_256). `needs`: what else to fill for the VNNI decode rows.
template <typename In>
inline void quantize_rows(const In* x, int64_t M, int64_t K, bool per256, DecodeNeeds needs, QuantX& xq) {
  xq.K64 = round_up(K, kChunk);
  xq.S = round_up(xq.K64 / kSub, 16);
  if (per256) {  // K a multiple of 256: every entry is written
    TORCH_CHECK(K % 256 == 0, "K-quant blocks need K a multiple of 256");
    at_least(xq.q256, M * xq.K64);
    at_least(xq.d256, M * xq.K64 / 256);
    at_least(xq.sum16, M * xq.K64 / kSub);
  }
  xq.K128 = round_up(K, 128);
  for (int sh = 0; sh < 8; sh++) {
    if (needs.zero16 >> sh & 1) rows_zero_tail(xq.zero_lane[sh], M, xq.K64 / 4, K / 4);
    if (needs.zero32 >> sh & 1) rows_zero_tail(xq.zero32[sh], M, xq.K128 / 8, K / 8);
  }
  if (needs.zero32) {
    // fill_block32 writes whole 128-column chunks but leaves holes in a last partial one: that is zeroed whole
    rows_zero_tail(xq.q128, M, xq.K128, K / 128 * 128);
    rows_zero_tail(xq.lane32, M, xq.K128 / 8, K / 8);
  }
  rows_zero_tail(xq.q, M, xq.K64, K);
  if (kVnniLanes) rows_zero_tail(xq.lane, M, xq.K64 / 4, K / 4);
  rows_zero_tail(xq.scale16, M, xq.S, K / kSub);
  rows_zero_tail(xq.corr, M, xq.S, K / kSub);
  rows_zero_tail(xq.nsum16, M, xq.S, K / kSub);
  std::fill_n(at_least(xq.nsum32, M * xq.K64 / 32), M * xq.K64 / 32, 0);  // summed into below
  auto rows = [&](int64_t m0, int64_t m1) {
    thread_local std::vector<int32_t> nsum;  // a row's lane sums (kept: a decode step rounds ~100 times)
    nsum.resize(xq.K64 / 4);
    for (int64_t m = m0; m < m1; m++) {
      int8_t* q = xq.q.data() + m * xq.K64;
      float* scale16 = xq.scale16.data() + m * xq.S;
      for (int64_t blk = 0; blk < K / kXBlock; blk++) {
        quantize_block(x + m * K + blk * kXBlock, q + blk * kXBlock, scale16[2 * blk]);
        scale16[2 * blk + 1] = scale16[2 * blk];
        if (kVnniLanes) std::fill_n(xq.lane.data() + m * xq.K64 / 4 + blk * 8, 8, scale16[2 * blk]);
      }
      minus_lane_sums(q, K, nsum.data());
      for (int64_t j = 0; j < K / kSub; j++) {  // the 16 codes' sum from their four lanes' (exact integers)
        const int sum = -(nsum[4 * j] + nsum[4 * j + 1] + nsum[4 * j + 2] + nsum[4 * j + 3]);
        xq.corr[m * xq.S + j] = scale16[j] * static_cast<float>(sum);
        xq.nsum16[m * xq.S + j] = -sum;
        xq.nsum32[m * xq.K64 / 32 + j / 2] -= sum;
        for (int sh = 0; sh < 8; sh++)
          if (needs.zero16 >> sh & 1) std::fill_n(xq.zero_lane[sh].data() + m * xq.K64 / 4 + 4 * j, 4, -sum * (1 << sh));
      }
      if (needs.zero32) fill_block32(q, xq.nsum32.data() + m * xq.K64 / 32, scale16, K, needs.zero32, m, xq);
      if (per256) quantize_row256(x + m * K, K, xq, m);
    }
  };
  if (M >= kParallelRows)
    radixserve::SpinPool::get().run(M, rows);
  else
    rows(0, M);
}

}  // namespace radixserve::gguf

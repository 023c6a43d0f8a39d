// Decode steps of the 32-weight formats (Q4_0, Q5_0, Q8_0) on AVX-512 VNNI: 128 columns (four blocks) a step, four
// weight rows side by side (eight at 6-8 activation rows: gguf_tiles.h, fused_rows), one float step per block.
//
// Why per block and not per 16 columns as the K-quants (gguf_decode.h): a block's weight scale d and the activations'
// scale are both constant over its 32 columns, so the two 16-column sums can be added in integers first. With lane
// 4 j + p of a register holding pair p's block j of the step (the 16 lanes: four weight rows by four blocks), the
// float step (cvt, mul, fma) serves 128 columns instead of 64, and the step's eight vpdpbusd per activation row take
// their operands in eight in-block broadcasts of the activations, as four did for 64 columns before. At eight rows
// the LM head took 5.6-5.8 ms against 7.6-7.9, gate_up 8.6-9.1 against 10.1-10.3 (two threads, from memory); one row
// level (RESULTS.md, issue 38 session 48). Q4_K and Q5_K (a scale per 32 too) were slower this way: their chunks
// already come two sub-blocks at a time, and the extra shuffles and registers cost more than the float steps saved.
//
// What keeps it bit-equal to the tiles (gguf_tiles.h, tile_rows with PerBlock) and so batch-invariant: per pair both
// compute each block's exact int32 sum (codes times activation codes, minus the zero point times the activations'
// sum), then acc[b % 4] += float(sum) * (d * x_scale) for blocks b in order, and add (acc0 + acc2) + (acc1 + acc3).
#pragma once

#include "gguf_activations.h"
#include "gguf_blocks.h"
#include "gguf_decode.h"

#include <algorithm>
#include <cstring>

#if defined(RADIXSERVE_GGUF_VNNI)

namespace radixserve::gguf {

// Blocks b and b + 1 of a row (blk: block b) as 64 codes in column order, each with its zero point (Q8_0: q + 128).
template <int64_t Type>
inline __m512i codes64(const uint8_t* blk) {
  constexpr int64_t kBytes = format_bytes(Type);
  if constexpr (Type == kQ8_0) {
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(load32(blk + 2)), load32(blk + kBytes + 2), 1);
    return _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));  // int8 q -> uint8 q + 128
  } else {
    // 16 bytes of each block to 128-bit lanes (0, 1) and (2, 3); the odd lanes shifted down to their high nibbles.
    constexpr int64_t qs = Type == kQ5_0 ? 6 : 2;
    const __m512i v = _mm512_mask_broadcast_i32x4(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qs))), 0xFF00,
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kBytes + qs)));
    const __m512i u = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFF00FF00, v, 4), _mm512_set1_epi8(0x0F));
    if constexpr (Type == kQ4_0) return u;
    uint32_t qh0, qh1;  // Q5_0: bit j of each block's qh is the fifth bit of its code j
    std::memcpy(&qh0, blk + 2, 4);
    std::memcpy(&qh1, blk + kBytes + 2, 4);
    return _mm512_mask_add_epi8(u, _cvtu64_mask64(qh0 | static_cast<uint64_t>(qh1) << 32), u, _mm512_set1_epi8(16));
  }
}

// The d of four rows' `n` blocks from `blk` (n = 4, or 2 at the end of a row of K = 64 mod 128; the rest 0), lane
// 4 j + p: row p's block j. The 16 fp16 values are gathered with scalar loads, then one conversion.
template <int64_t Type>
inline __m512 block_d(const uint8_t* const* rows, int64_t blk, int n) {
  constexpr int64_t kBytes = format_bytes(Type);
  uint64_t h[4] = {0, 0, 0, 0};
  for (int j = 0; j < n; j++)
    for (int p = 0; p < 4; p++) {
      uint16_t v;
      std::memcpy(&v, rows[p] + (blk + j) * kBytes, 2);
      h[j] |= static_cast<uint64_t>(v) << (16 * p);
    }
  const __m256i bits = _mm256_set_epi64x(static_cast<int64_t>(h[3]), static_cast<int64_t>(h[2]),
                                         static_cast<int64_t>(h[1]), static_cast<int64_t>(h[0]));
  return _mm512_cvtph_ps(bits);
}

// y[r * ldy + j] (j < nr <= 4 G) for RB activation rows from m0 against the weight rows from `row` (row_bytes
// apart), as decode_rows (gguf_decode.h) does for the K-quants: the last weight row repeated past nr; G = 2 shares
// the activations' loads and broadcasts between two groups of four, each group's arithmetic G = 1's.
template <int64_t Type, int RB, bool LongRows, int G = 1>
inline void decode_rows32(const uint8_t* row, int64_t row_bytes, int nr, const QuantX& x, int64_t m0, float* y,
                          int64_t ldy) {
  constexpr int NW = 4 * G;
  constexpr int64_t kBytes = format_bytes(Type), span = NW * 4 * kBytes;  // the NW rows' bytes per step
  constexpr int shift = zero_shift(Type);
  const int64_t blocks = x.K64 / kXBlock;
  const uint8_t* rows[NW];
  for (int j = 0; j < NW; j++) rows[j] = row + std::min(j, nr - 1) * row_bytes;
  const uint8_t* ahead = row + (LongRows ? kLongAhead : kPrefetchAhead);
  __m512 acc[RB][G];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t c = 0; c < x.K128 / 128; c++) {
    const int n = static_cast<int>(std::min<int64_t>(4, blocks - 4 * c));  // blocks in this step: 4, or 2 at the end
    for (int64_t o = 0; o < span; o += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
    ahead += span;
    // lo[j] 128-bit lane k: the first 16 codes of row j's block k; hi[j]: the second 16. Then by group (by_group):
    // lo[4 g + t] lane 4 k + p holds row 4 g + p's codes 4 t .. 4 t + 3 of block k (hi: 16 + 4 t ..).
    __m512i lo[NW], hi[NW];
    for (int j = 0; j < NW; j++) {
      const uint8_t* b = rows[j] + 4 * c * kBytes;
      const __m512i c0 = codes64<Type>(b), c1 = n == 4 ? codes64<Type>(b + 2 * kBytes) : _mm512_setzero_si512();
      lo[j] = _mm512_shuffle_i32x4(c0, c1, 0x88);
      hi[j] = _mm512_shuffle_i32x4(c0, c1, 0xDD);
    }
    __m512 ap[G];
    for (int g = 0; g < G; g++) {
      by_group(lo + 4 * g);
      by_group(hi + 4 * g);
      ap[g] = block_d<Type>(rows + 4 * g, 4 * c, n);
    }
    for (int r = 0; r < RB; r++) {
      const int64_t m = m0 + r, at = m * x.K128 / 8 + 16 * c;
      const int8_t* q = &x.q128[m * x.K128 + 128 * c];
      const __m512i ql = _mm512_loadu_si512(q), qh = _mm512_loadu_si512(q + 64);
      __m512i qt[8];  // 128-bit lane k: the activations' 4-code group t of block k (its first half; 4 + t: second)
      for (int t = 0; t < 4; t++) {
        qt[t] = _mm512_shuffle_epi32(ql, static_cast<_MM_PERM_ENUM>(0x55 * t));
        qt[4 + t] = _mm512_shuffle_epi32(qh, static_cast<_MM_PERM_ENUM>(0x55 * t));
      }
      const __m512i init = _mm512_loadu_si512(&x.zero32[shift][at]);
      const __m512 lane = _mm512_loadu_ps(&x.lane32[at]);
      for (int g = 0; g < G; g++) {
        __m512i sums = init;
        for (int t = 0; t < 4; t++) sums = _mm512_dpbusd_epi32(sums, lo[4 * g + t], qt[t]);
        for (int t = 0; t < 4; t++) sums = _mm512_dpbusd_epi32(sums, hi[4 * g + t], qt[4 + t]);
        acc[r][g] = sub_step(acc[r][g], sums, ap[g], lane);
      }
    }
  }
  for (int r = 0; r < RB; r++)
    for (int g = 0; g < G && 4 * g < nr; g++) store_rows(y + r * ldy + 4 * g, sub_total(acc[r][g]), std::min(4, nr - 4 * g));
}

}  // namespace radixserve::gguf

#endif

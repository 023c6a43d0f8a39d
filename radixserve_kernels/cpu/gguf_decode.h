// Decode steps of the GGUF K-quant linears (Q4_K, Q5_K, Q6_K) on AVX-512 VNNI (1-8 activation rows per pass;
// gguf_tiles.h makes more passes for up to kFusedRows; the 32-weight formats: gguf_decode32.h, which shares the
// helpers here): the codes go from the blocks straight into registers, 64 at a time in their natural order, four
// weight rows side by side (eight at 6-8 activation rows: gguf_tiles.h, fused_rows) so that each load of the
// activations serves them all.
//
// What keeps it bit-equal to the tiles of gguf_tiles.h (prefill), and so batch-invariant: per (activation row,
// weight row) pair both compute the exact integer sum of each 16-column sub-block (codes times activation codes,
// minus the zero point times the activations' sum), then run `sub_step` on the sub-blocks in the same order with the
// same floats (a per 16 weights exactly as gguf_blocks.h unpacks them, the activations' block scale), into four
// accumulators by sub-block mod 4, added as `sub_total` does; Q4_K's and Q5_K's offsets sum in offsets()'s order.
#pragma once

#include "gguf_activations.h"
#include "gguf_blocks.h"

#include <algorithm>
#include <vector>

#if defined(RADIXSERVE_GGUF_VNNI)

namespace radixserve::gguf {

// The sums of 16-column sub-blocks, the unit every AVX-512 dot product here is built on: for four (activation row,
// weight row) pairs p = 0..3 at once (one 64-column chunk each), lane 4 s + p of one register holds pair p's exact
// int32 sum over sub-block s (columns 16 s .. 16 s + 15). vpdpbusd adds 4 columns into each lane, so the four weight
// rows' chunks (u[p]: row p's 64 codes in column order) are first transposed by 4-byte groups within each 128-bit
// block: then a vpdpbusd of u[t] against the activations' group t of each 16 columns (`_mm512_shuffle_epi32(q,
// 0x55 t)`) adds row p's columns 16 s + 4 t .. 16 s + 4 t + 3 into lane 4 s + p, and four of them (t = 0..3) make
// the sums. The transpose (eight shuffles) serves every activation row of a pass; reducing the lanes of a vpdpbusd
// per row and column instead took nine operations an activation row, the largest cost at eight rows (RESULTS.md,
// issue 38 session 47).
inline void by_group(__m512i u[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(u[0], u[1]), t1 = _mm512_unpackhi_epi32(u[0], u[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(u[2], u[3]), t3 = _mm512_unpackhi_epi32(u[2], u[3]);
  u[0] = _mm512_unpacklo_epi64(t0, t2);
  u[1] = _mm512_unpackhi_epi64(t0, t2);
  u[2] = _mm512_unpacklo_epi64(t1, t3);
  u[3] = _mm512_unpackhi_epi64(t1, t3);
}

// The one float step of every AVX-512 dot product here, per pair and sub-block s: acc[s % 4] += float(sum of s) *
// (a_s * x_scale_s) as one fma. The tiles (gguf_tiles.h) hold a pair's four accumulators in four registers; the
// decode rows below hold them in lanes 4 (s % 4) + p of one.
inline __m512 sub_step(__m512 acc, __m512i sums, __m512 a, __m512 x_scale) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(a, x_scale), acc);
}

// A pair's result from its four accumulators: (acc0 + acc2) + (acc1 + acc3), here for the four pairs in the lanes
// of one register (lane 4 k + p: pair p's acc k).
inline __m128 sub_total(__m512 acc) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The first n (<= 4) of four weight rows' results to y. One store for four: a loop over n the compiler turned into a
// call to memcpy, 1.3% of a decode step's CPU time (perf, cpu-clock samples).
inline void store_rows(float* y, __m128 total, int n) {
  if (n == 4) {
    _mm_storeu_ps(y, total);
  } else {
    alignas(16) float t[4];
    _mm_store_ps(t, total);
    for (int j = 0; j < n; j++) y[j] = t[j];
  }
}

// Four rows' a per 16 weights of a 256-weight super-block (a16[p] lane 4 c + k: row p's a of sub-block k of chunk c)
// as the chunks' sums take them: out[c] lane 4 k + p. A 4 x 4 transpose of 4 x 4 blocks, 12 shuffles a super-block,
// where a permute per row and chunk and three blends per chunk took 28; the same floats in the same lanes.
inline void chunk_a(const __m512 a16[4], __m512 out[4]) {
  // On the bits (integer shuffles: those SIMDe's emulated build, tests/test_gguf_kernels.py, also has).
  __m512i r[4];
  for (int p = 0; p < 4; p++) r[p] = _mm512_castps_si512(a16[p]);
  const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
  // u[k], 128-bit block c: rows 0-3's a of sub-block k of chunk c
  const __m512i u0 = _mm512_unpacklo_epi64(t0, t2), u1 = _mm512_unpackhi_epi64(t0, t2);
  const __m512i u2 = _mm512_unpacklo_epi64(t1, t3), u3 = _mm512_unpackhi_epi64(t1, t3);
  const __m512i v0 = _mm512_shuffle_i32x4(u0, u1, 0x44), v1 = _mm512_shuffle_i32x4(u0, u1, 0xEE);
  const __m512i v2 = _mm512_shuffle_i32x4(u2, u3, 0x44), v3 = _mm512_shuffle_i32x4(u2, u3, 0xEE);
  out[0] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(v0, v2, 0x88));
  out[1] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(v0, v2, 0xDD));
  out[2] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(v1, v3, 0x88));
  out[3] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(v1, v3, 0xDD));
}

// One weight row's chunk: 64 codes in column order; the a per 16 weights of the super-block (chunk_a lays four rows'
// out for the chunks), and for Q4_K and Q5_K the b per 16 (the offsets). Each format reads `rows` side by side;
// `begin(s)` prepares super-block s (scales), `chunk(c)` gives chunk c of it. (The 32-weight formats: gguf_decode32.h.)
template <int64_t Type>
struct Reader;

// Q4_K and Q5_K: chunk c holds sub-blocks 2c (low nibbles of qs[32c ..]) and 2c + 1 (high nibbles); Q5_K's fifth
// bits are bits 2c and 2c + 1 of qh[0..31].
template <int64_t Type>
struct MinReader {
  static constexpr int64_t kWeights = 256, kChunks = 4, kBytes = format_bytes(Type), kQs = Type == kQ5_K ? 48 : 16;
  const uint8_t* row;
  const uint8_t* blk = nullptr;
  __m512 a16, b16;  // a and b per 16 weights (a sub-block of 32 spans two)

  void begin(int64_t s) {
    blk = row + s * kBytes;
    // In registers: q4_k_scales (scalar: four dword stores, then one vector load of them) stalled on the store
    // forwarding once a row and super-block.
    const __m128i bytes = q4_k_scales128(blk);  // sc 0-3, sc 4-7, m 0-3, m 4-7
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    int32_t dw;
    std::memcpy(&dw, blk, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dw));  // d, dmin
    const __m512 d = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                           _mm512_castps128_ps512(dm));
    const __m512 ab = _mm512_mul_ps(v, d);  // d sc (lanes 0-7), dmin m (lanes 8-15): as unpack_q4_k's products
    a16 = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), ab);
    b16 = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), ab);
  }

  __m512i chunk(int c) const {
    const __m256i v = load32(blk + kQs + 32 * c);
    const __m512i u = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1),
                                       _mm512_set1_epi8(0x0F));
    if constexpr (Type == kQ4_K) return u;
    // Bits 2c (low half) and 2c + 1 (high half) of each qh byte to bit 0 (the 16-bit shifts' spill lands higher),
    // then to 16.
    const __m512i h = _mm512_srlv_epi16(_mm512_broadcast_i64x4(load32(blk + 16)),
                                        _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(2 * c)),
                                                           _mm256_set1_epi16(static_cast<short>(2 * c + 1)), 1));
    return _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(1)), 4));
  }
};

template <>
struct Reader<kQ4_K> : MinReader<kQ4_K> {};
template <>
struct Reader<kQ5_K> : MinReader<kQ5_K> {};

// Q6_K: per 128-weight half, chunk 0 takes the low nibbles of ql[0..63] with qh bits 0-1 (columns 0-31) and 2-3
// (32-63); chunk 1 the high nibbles with bits 4-5 and 6-7 (see unpack_q6_k).
template <>
struct Reader<kQ6_K> {
  static constexpr int64_t kWeights = 256, kChunks = 4, kBytes = 210;
  const uint8_t* row;
  const uint8_t* blk = nullptr;
  __m512 a16;

  void begin(int64_t s) {
    blk = row + s * kBytes;
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    a16 = _mm512_mul_ps(_mm512_set1_ps(fp16(blk + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
  }

  static __m512i halves(short lo, short hi) {
    return _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1);
  }

  __m512i chunk(int c) const {
    const uint8_t* ql = blk + 64 * (c / 2);
    const __m512i l = _mm512_loadu_si512(ql);
    const __m512i h = _mm512_broadcast_i64x4(load32(blk + 128 + 32 * (c / 2)));
    const __m512i two = _mm512_set1_epi8(0x30), low = _mm512_set1_epi8(0x0F);
    // Each 256-bit half's qh bits to bits 4-5: by << 4 and << 2 (chunk 0), >> 0 and >> 2 (chunk 1).
    const __m512i hs = c % 2 == 0 ? _mm512_sllv_epi16(h, halves(4, 2)) : _mm512_srlv_epi16(h, halves(0, 2));
    const __m512i nib = c % 2 == 0 ? l : _mm512_srli_epi16(l, 4);
    return _mm512_or_si512(_mm512_and_si512(nib, low), _mm512_and_si512(hs, two));
  }
};

// Bytes ahead of the weight rows being read that are prefetched into L2, one sweep over the rows' span at their
// combined pace; rows longer than kLongRow prefetch further. History, all on this path:
// - Session 17 (one thread, all 24 layers): a sweep 8-16 KiB ahead against the old prefetch of a whole tile at its
//   start: gate_up 1.45x, down 1.4x faster.
// - Session 19 (benchmarks.gguf_linear, two threads, all layers, alternated): the long rows (down, K = 4864) into L2
//   at 24 KiB instead of L1 at 12 KiB: down 3.5-4.5 -> 2.9-3.4 ms a step (L2 at 12 KiB 3.0-3.4, L1 at 24 KiB 3.8-4.2,
//   L2 at 6 KiB 4.5). The likely reason (no counters on this VM): an activation row of K = 4864 is ~15 KB of codes,
//   lane scales and sums read from L1 by every weight row, which weights prefetched into the 32 KiB L1 push out.
// - Session 46 (benchmarks.decode_ab, whole decode steps against llama-server, alternated rounds on a Zen 4): the
//   K = 896 rows (q/k/v, o, gate_up, LM head) into L2 as well, at 12 KiB: 1.08x the tokens/s of L1 at 12 KiB (median
//   of 10 rounds); then at 6 KiB: 1.045x that; at 3 KiB 0.91x and at 24 KiB 0.94x. The long rows at 12 KiB instead of
//   24: 1.057x and 0.974x in two runs, level, so they stayed.
// On AVX2 (gguf_decode_avx2.h) the session-19 change measured no different (its down is bound by compute), and at 4-8
// activation rows neither.
constexpr int64_t kPrefetchAhead = 6144, kLongAhead = 24576;
constexpr int64_t kLongRow = 2048;

// The b's decode_rows keeps for late_offsets (below), n registers' worth, kept from call to call as QuantX's buffers
// (gguf_activations.h, at_least).
inline float* b16_buffer(int64_t n) {
  thread_local std::vector<float> kept;
  return at_least(kept, 16 * n);
}

// Q4_K's and Q5_K's offsets after decode_rows' loop at eight weight rows a pass: off[r][j] (16 lanes, one per
// sub-block of a super-block) = the sum over super-blocks s, in order, of weight row j's b per 16 (at kept + 16 (s NW +
// j)) times activation row m0 + r's corr. Inside the loop they took a register per (activation row, weight row), 64 at
// eight by eight, spilled to memory and back every super-block; layer 2's Q4_K down at eight rows took 1.27x the
// time of layer 0's Q6_K (RESULTS.md, issue 38 session 49). Here one weight row's RB sums at a time, the same fmas
// in the same order: the same bits.
template <int RB, int NW>
inline void late_offsets(const float* kept, int64_t supers, const QuantX& x, int64_t m0, __m512 (&off)[RB][NW]) {
  for (int j = 0; j < NW; j++) {
    __m512 o[RB];
    for (auto& v : o) v = _mm512_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
      const __m512 b = _mm512_loadu_ps(kept + 16 * (s * NW + j));
      for (int r = 0; r < RB; r++) o[r] = _mm512_fmadd_ps(b, _mm512_loadu_ps(&x.corr[(m0 + r) * x.S + 16 * s]), o[r]);
    }
    for (int r = 0; r < RB; r++) off[r][j] = o[r];
  }
}

// y[r * ldy + j] (j < nr <= 4 G) for RB activation rows from m0 against the weight rows from `row` (row_bytes apart).
// Always 4 G weight rows side by side, the last repeated past nr: each group of four makes, per activation row, one
// register of sub-block sums. G = 2: two groups share each load and broadcast of the activations (codes, zero-point
// sums, scales) and the loop, and each group's arithmetic is G = 1's, so the bits are the same. Where it serves is
// fused_rows' choice (gguf_tiles.h), from measurements on a Zen 4 (RESULTS.md, issue 38 sessions 45-47).
template <int64_t Type, int RB, bool LongRows, int G = 1>
inline void decode_rows(const uint8_t* row, int64_t row_bytes, int nr, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  using R = Reader<Type>;
  constexpr int NW = 4 * G;  // weight rows side by side
  constexpr int64_t span = NW * R::kBytes;  // bytes of the NW rows per super-block
  const uint8_t* ahead = row + (LongRows ? kLongAhead : kPrefetchAhead);
  constexpr int shift = zero_shift(Type);
  R w[NW];
  for (int j = 0; j < NW; j++) w[j].row = row + std::min(j, nr - 1) * row_bytes;
  // Q4_K's and Q5_K's b per 16 of each super-block, kept for late_offsets at eight weight rows a pass
  constexpr bool late = has_minima(Type) && G > 1;
  const int64_t supers = x.K64 / R::kWeights;
  float* kept = nullptr;
  if constexpr (late) kept = b16_buffer(supers * NW);
  __m512 acc[RB][G], off[RB][NW];  // off: Q4_K's and Q5_K's offsets (late_offsets writes all of them)
  for (int r = 0; r < RB; r++) {
    for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();
    if constexpr (!late)
      for (int j = 0; j < NW; j++) off[r][j] = _mm512_setzero_ps();
  }
  for (int64_t s = 0; s < supers; s++) {
    for (int j = 0; j < NW; j++) w[j].begin(s);
    if constexpr (late)  // stored now, so that the b's hold no register through the chunks
      for (int j = 0; j < NW; j++) _mm512_storeu_ps(kept + 16 * (s * NW + j), w[j].b16);
    __m512 a_chunks[G][4];
    for (int g = 0; g < G; g++) {
      const __m512 a16[4] = {w[4 * g].a16, w[4 * g + 1].a16, w[4 * g + 2].a16, w[4 * g + 3].a16};
      chunk_a(a16, a_chunks[g]);
    }
    for (int64_t o = 0; o < span; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T1);
    ahead += span;
    for (int c = 0; c < R::kChunks; c++) {
      const int64_t cc = s * R::kChunks + c;  // the chunk's index in the row
      __m512i u[NW];
      __m512 ap[G];  // lane 4 k + p: weight row 4 g + p's a of sub-block k
      for (int j = 0; j < NW; j++) u[j] = w[j].chunk(c);
      for (int g = 0; g < G; g++) {
        by_group(u + 4 * g);
        ap[g] = a_chunks[g][c];
      }
      for (int r = 0; r < RB; r++) {
        const int64_t m = m0 + r;
        const __m512i q = _mm512_loadu_si512(&x.q[m * x.K64 + cc * kChunk]);
        __m512i qt[4];  // 128-bit block s: the 4-code group t of columns 16 s .. 16 s + 15, four times
        for (int t = 0; t < 4; t++) qt[t] = _mm512_shuffle_epi32(q, static_cast<_MM_PERM_ENUM>(0x55 * t));
        __m512i init = _mm512_setzero_si512();
        if constexpr (shift >= 0) init = _mm512_loadu_si512(&x.zero_lane[shift][m * x.K64 / 4 + cc * 16]);
        // x.lane: lanes 0-7 hold the scale of the chunk's first 32 columns (sub-blocks 0, 1), 8-15 the second's.
        const __m512 lane = _mm512_loadu_ps(&x.lane[m * x.K64 / 4 + cc * 16]);
        for (int g = 0; g < G; g++) {
          __m512i sums = init;
          for (int t = 0; t < 4; t++) sums = _mm512_dpbusd_epi32(sums, u[4 * g + t], qt[t]);
          acc[r][g] = sub_step(acc[r][g], sums, ap[g], lane);
        }
      }
    }
    if constexpr (!late && has_minima(Type))  // the offsets, in offsets()'s order: 16 per super-block
      for (int r = 0; r < RB; r++)
        for (int j = 0; j < NW; j++) off[r][j] = _mm512_fmadd_ps(w[j].b16, _mm512_loadu_ps(&x.corr[(m0 + r) * x.S + 16 * s]), off[r][j]);
  }
  if constexpr (late) late_offsets<RB, NW>(kept, supers, x, m0, off);
  for (int r = 0; r < RB; r++)
    for (int g = 0; g < G && 4 * g < nr; g++) {
      __m128 total = sub_total(acc[r][g]);
      if constexpr (has_minima(Type)) {
        const __m512* o = off[r] + 4 * g;
        total = _mm_sub_ps(total, _mm_setr_ps(_mm512_reduce_add_ps(o[0]), _mm512_reduce_add_ps(o[1]),
                                              _mm512_reduce_add_ps(o[2]), _mm512_reduce_add_ps(o[3])));
      }
      store_rows(y + r * ldy + 4 * g, total, std::min(4, nr - 4 * g));
    }
}

}  // namespace radixserve::gguf

#endif

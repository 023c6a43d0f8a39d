// The GGUF linears' dot products on AVX2 (no VNNI) for the whole-chunk formats Q4_0, Q5_0 and Q8_0: one 32-column
// chunk at a time. They serve the tiles of gguf_linear.cpp (prefill: codes unpacked by gguf_blocks.h) and decode
// steps, whose codes go from the blocks straight into registers (at most kFusedRows activation rows; no tile buffer,
// no second pass over the codes). Q4_K and Q6_K: gguf_kquants_avx2.h.
//
// The integers: vpmaddubsw multiplies unsigned codes by the activations' int8 codes and adds pairs into int16, then
// vpmaddwd adds those pairs, so int32 lane l holds columns 4l .. 4l + 3, as a vpdpbusd lane does. It is exact for
// codes up to 63 (2 * 63 * 127 < 2^15): Q4_0, Q5_0, Q4_K, Q6_K. Q8_0's codes would saturate vpmaddubsw, so its
// signed codes go through ggml's sign trick: |q| times x with q's sign, exact (2 * 128 * 127).
//
// The floats (one scale a per 32 columns, activations rounded per 32): eight weight rows at a time, each chunk's
// lanes added into one integer per row (exact; the zero points Q4_0 8 and Q5_0 16 taken out there with the chunk's
// sum of activation codes), then acc += float(sum) * (a * x_scale) once for all eight rows, lane j holding row j
// (`rows_step`); for Q4_0 and Q5_0 from kLanesFrom activation rows on, the eight rows' codes are transposed first so
// that the lanes are weight rows (`lanes_chunk`: the same integers, no reduction per activation row). Chunks run in
// column order; a row's result depends neither on the path nor on the row count.
#pragma once

#include "gguf_activations.h"
#include "gguf_blocks.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && !defined(RADIXSERVE_GGUF_VNNI)

namespace radixserve::gguf {

constexpr int64_t kChunk32 = 32;

// The zero point the whole-chunk formats take out in the integers: 2^shift; Q8_0 (sign trick) takes none.
constexpr int avx2_zero_shift(int64_t type) { return type == kQ4_0 ? 3 : type == kQ5_0 ? 4 : -1; }

// Lane l: the exact sum of x * u over columns 4l .. 4l + 3 of one weight row's chunk, zero point left in (Q8_0: the
// sign trick on q = u - 128, so none; |q| is 128 for -128, unsigned, and the activations' codes are within +-127).
template <int64_t Type>
inline __m256i lanes32(__m256i u, __m256i xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Type == kQ8_0) {
    const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xq, q)), ones);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), ones);
  }
}

// Q4_0, Q5_0, Q8_0: a is one scale for a whole 32-column chunk, so the eight int32 lanes of a chunk's dot product
// can be added into one integer per weight row before any float work. Eight weight rows then share one conversion,
// one scale product and one fma per chunk (lane j: row j), where the lanes take those three per row plus the zero
// point's add and a final horizontal sum (measured on a Zen 3 AVX2 CPU: RESULTS.md, issue 38 session 25).
template <int64_t Type>
constexpr bool whole_chunks() { return Type == kQ4_0 || Type == kQ5_0 || Type == kQ8_0; }

constexpr int kRowGroup = 8;  // weight rows a `rows_step` serves: one register of float32 lanes

// The lanes of two weight rows' chunks (l0, l1) added pairwise: lanes 0-3 of each 128-bit half hold l0's lanes 0+2,
// l1's 0+2, l0's 1+3, l1's 1+3 of that half. The first step of `row_sums8`, taken as soon as two rows are done so
// that few registers stay live.
inline __m256i pair_sums(__m256i l0, __m256i l1) {
  return _mm256_add_epi32(_mm256_unpacklo_epi32(l0, l1), _mm256_unpackhi_epi32(l0, l1));
}

// Lane j: the sum of the eight lanes of row j's chunk, from the four pair_sums of rows (0, 1) .. (6, 7) (integers:
// exact in any order). Unpacks and adds, not vphaddd: on Zen 3 a vphaddd measured ~4x an unpack's throughput cost
// (RESULTS.md, issue 38 session 25).
inline __m256i row_sums8(const __m256i* p) {
  __m256i q[2];
  for (int k = 0; k < 2; k++)  // rows 4k .. 4k + 3, one per lane of each half: [low half's sums | high half's]
    q[k] = _mm256_add_epi32(_mm256_unpacklo_epi64(p[2 * k], p[2 * k + 1]), _mm256_unpackhi_epi64(p[2 * k], p[2 * k + 1]));
  // [rows 0-3 low | rows 4-7 high] + [rows 0-3 high | rows 4-7 low]
  return _mm256_add_epi32(_mm256_blend_epi32(q[0], q[1], 0xF0), _mm256_permute2x128_si256(q[0], q[1], 0x21));
}

// One activation row as the whole-chunk formats read it, taken once before the chunk loop: indexed from the QuantX
// in the loop, the row's offsets were recomputed every chunk (~10 of 134 instructions an eight-row chunk, RESULTS.md
// issue 38 session 29).
struct XRow {
  const int8_t* q;        // the codes, 32 a chunk
  const float* scale16;   // the scale per 16 columns: chunk c's at 2c
  const int32_t* nsum32;  // minus the sum of each chunk's codes
};

template <int RB>
inline void x_rows(const QuantX& x, int64_t m0, XRow (&xr)[RB]) {
  for (int r = 0; r < RB; r++)
    xr[r] = {&x.q[(m0 + r) * x.K64], &x.scale16[(m0 + r) * x.S], &x.nsum32[(m0 + r) * x.K64 / kChunk32]};
}

// acc + float(sums - zero * (the chunk's sum of activation codes)) * (a * x_scale) for activation row xr, chunk c:
// the float step of eight weight rows (a: their scales, lane j row j).
template <int64_t Type>
inline __m256 rows_step(__m256 acc, __m256i sums, __m256 a, const XRow& xr, int64_t c) {
  constexpr int shift = avx2_zero_shift(Type);
  if constexpr (shift >= 0) sums = _mm256_add_epi32(sums, _mm256_slli_epi32(_mm256_set1_epi32(xr.nsum32[c]), shift));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(a, _mm256_set1_ps(xr.scale16[2 * c])), acc);
}

// acc[r] for RB activation rows xr against eight weight rows' chunk c: codes(j) gives row j's codes, a their
// scales. Two rows at a time, reduced to pair_sums at once (eight rows' codes and lanes together spilled registers).
template <int64_t Type, int RB, typename Codes>
inline void rows_chunk(__m256 (&acc)[RB], const Codes& codes, __m256 a, const XRow (&xr)[RB], int64_t c) {
  __m256i p[RB][4];
  for (int k = 0; k < 4; k++) {
    const __m256i u0 = codes(2 * k), u1 = codes(2 * k + 1);
    for (int r = 0; r < RB; r++) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r].q + c * kChunk32));
      p[r][k] = pair_sums(lanes32<Type>(u0, xq), lanes32<Type>(u1, xq));
    }
  }
  for (int r = 0; r < RB; r++) acc[r] = rows_step<Type>(acc[r], row_sums8(p[r]), a, xr[r], c);
}

// Q4_0 and Q5_0 keep a chunk's 32 codes as 16 bytes of nibbles (codes 0-15 low, 16-31 high; Q5_0's fifth bits in the
// uint32 qh before them). Two weight rows' bytes fill one register, [row A | row B], so one and gives both rows' low
// nibbles (lo: [A's columns 0-15 | B's 0-15]) and one shift and and their high ones (hi: columns 16-31).
template <int64_t Type>
constexpr bool nibble_chunks() { return Type == kQ4_0 || Type == kQ5_0; }

inline __m256i load_u32x8(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(static_cast<int>(v));
}

// lo and hi of the chunks at blocks a and b (Q5_0: with the fifth bits, as codes32 gives them).
template <int64_t Type>
inline void codes_pair(const uint8_t* a, const uint8_t* b, __m256i& lo, __m256i& hi) {
  constexpr int64_t qs = Type == kQ5_0 ? 6 : 2;
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + qs))),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qs)), 1);
  lo = low4(v);
  hi = high4(v);
  if constexpr (Type == kQ5_0) {
    // Each half holds A's qh, A's qh << 4, B's qh, B's qh << 4 (dwords 0-3). Byte j of lo takes its column's qh byte
    // (j / 8 of A's, or of B's in the upper half; hi: the two after it) from the copy where its bit j % 8 sits in the
    // high nibble (j % 8 < 4: the shifted one), so the bit tested is 16, 32, 64 or 128, and a min with 16 gives the
    // fifth bit's 16 or 0 (one operation fewer than codes32's compare and and).
    const __m256i both = _mm256_blend_epi32(load_u32x8(a + 2), load_u32x8(b + 2), 0xCC);
    const __m256i h = _mm256_sllv_epi32(both, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201080402010)), sixteen = _mm256_set1_epi8(16);
    const auto fifth = [&](__m256i index) {
      return _mm256_min_epu8(_mm256_and_si256(_mm256_shuffle_epi8(h, index), bit), sixteen);
    };
    lo = _mm256_or_si256(lo, fifth(_mm256_set_epi64x(0x090909090D0D0D0D, 0x080808080C0C0C0C, 0x0101010105050505,
                                                     0x0000000004040404)));
    hi = _mm256_or_si256(hi, fifth(_mm256_set_epi64x(0x0B0B0B0B0F0F0F0F, 0x0A0A0A0A0E0E0E0E, 0x0303030307070707,
                                                     0x0202020206060606)));
  }
}

// acc[r] for RB activation rows xr against the chunk c of eight nibble-format weight rows, a their scales;
// pair(k, lo, hi) gives rows k and k + 4 as codes_pair does (from the blocks, or from a tile's unpacked rows). Per
// pair both halves' products add in int16 (at most 4 x 31 x 127, exact), one vpmaddwd gives [row k's 4 lanes | row
// k + 4's], and three unpack rounds give lane j = row j's sum (the same integers as rows_chunk's, so the same bits;
// 149 -> 134 instructions per eight-row chunk with codes_pair's min, no pair_sums: RESULTS.md, issue 38 session 27).
template <int64_t Type, int RB, typename Pair>
inline void pairs_chunk(__m256 (&acc)[RB], const Pair& pair, __m256 a, const XRow (&xr)[RB], int64_t c) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p[RB][4];
  for (int k = 0; k < 4; k++) {
    __m256i lo, hi;
    pair(k, lo, hi);
    for (int r = 0; r < RB; r++) {
      const int8_t* xq = xr[r].q + c * kChunk32;
      const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq)));
      const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16)));
      p[r][k] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)), ones);
    }
  }
  for (int r = 0; r < RB; r++) {
    __m256i q[2];  // q[h]: pairs 2h, 2h + 1 -> [rows 2h, 2h + 1, 2h, 2h + 1 | rows 2h + 4, 2h + 5, ...], half sums
    for (int h = 0; h < 2; h++)
      q[h] = _mm256_add_epi32(_mm256_unpacklo_epi32(p[r][2 * h], p[r][2 * h + 1]),
                              _mm256_unpackhi_epi32(p[r][2 * h], p[r][2 * h + 1]));
    const __m256i sums = _mm256_add_epi32(_mm256_unpacklo_epi64(q[0], q[1]), _mm256_unpackhi_epi64(q[0], q[1]));
    acc[r] = rows_step<Type>(acc[r], sums, a, xr[r], c);
  }
}

// A 4 x 4 transpose of 32-bit words within each 128-bit half: word w of a_i becomes word i of a_w.
inline void transpose4(__m256i& a0, __m256i& a1, __m256i& a2, __m256i& a3) {
  const __m256i t0 = _mm256_unpacklo_epi32(a0, a1), t1 = _mm256_unpackhi_epi32(a0, a1);
  const __m256i t2 = _mm256_unpacklo_epi32(a2, a3), t3 = _mm256_unpackhi_epi32(a2, a3);
  a0 = _mm256_unpacklo_epi64(t0, t2);
  a1 = _mm256_unpackhi_epi64(t0, t2);
  a2 = _mm256_unpacklo_epi64(t1, t3);
  a3 = _mm256_unpackhi_epi64(t1, t3);
}

// Activation codes 4g .. 4g + 3 at xq in every dword: one broadcast load that meets all eight weight rows.
inline __m256i codes4(const int8_t* xq, int g) {
  int32_t v;
  std::memcpy(&v, xq + 4 * g, 4);
  return _mm256_set1_epi32(v);
}

// Lane j: the int32 sum over 16 columns of weight row j's codes times one activation row's (xq, 16 int8 codes),
// from t[g] lane j = row j's codes 4g .. 4g + 3. Each activation row's four codes are one broadcast load meeting all
// eight rows, so nothing is reduced across lanes. The int16 words of four vpmaddubsw add exactly (4 x 2 x 31 x 127 <
// 2^15).
inline __m256i lanes16(const __m256i (&t)[4], const int8_t* xq) {
  const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(t[0], codes4(xq, 0)), _mm256_maddubs_epi16(t[1], codes4(xq, 1)));
  const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(t[2], codes4(xq, 2)), _mm256_maddubs_epi16(t[3], codes4(xq, 3)));
  return _mm256_madd_epi16(_mm256_add_epi16(s01, s23), _mm256_set1_epi16(1));
}

// acc[r] for RB activation rows xr against chunk c of eight weight rows whose codes come with the lanes as weight
// rows: lanes(h, t) gives half h's (columns 16h .. 16h + 15) four registers as lanes16 reads them. Lane j of an
// activation row's sums is row j's, with no per-row reduction; the same integers go into the same rows_step as
// pairs_chunk's and rows_chunk's, so the same bits.
template <int64_t Type, int RB, typename Lanes>
inline void lanes_sums(__m256 (&acc)[RB], const Lanes& lanes, __m256 a, const XRow (&xr)[RB], int64_t c) {
  __m256i sums[RB];
  for (int h = 0; h < 2; h++) {
    __m256i t[4];
    lanes(h, t);
    for (int r = 0; r < RB; r++) {
      const __m256i s = lanes16(t, xr[r].q + c * kChunk32 + 16 * h);
      sums[r] = h == 0 ? s : _mm256_add_epi32(sums[r], s);
    }
  }
  for (int r = 0; r < RB; r++) acc[r] = rows_step<Type>(acc[r], sums[r], a, xr[r], c);
}

// pairs_chunk's result (Q4_0, Q5_0) with the lanes as weight rows instead of columns: the eight rows' codes of each
// 16-column half transposed (half(k, h): [row k | row k + 4] columns 16h .. 16h + 15), then lanes_sums. The
// transposes are per chunk and the reductions saved per activation row: level at two rows, ahead from four.
// Q8_0 keeps rows_chunk: its sign trick costs an operation per activation row and group here, and its LM head
// measured no faster this way (RESULTS.md, issue 38 session 38).
template <int64_t Type, int RB, typename Half>
inline void lanes_chunk(__m256 (&acc)[RB], const Half& half, __m256 a, const XRow (&xr)[RB], int64_t c) {
  static_assert(nibble_chunks<Type>());
  const auto lanes = [&](int h, __m256i (&t)[4]) {
    for (int k = 0; k < 4; k++) t[k] = half(k, h);
    transpose4(t[0], t[1], t[2], t[3]);
  };
  lanes_sums<Type, RB>(acc, lanes, a, xr, c);
}

// Activation rows from which a chunk of eight weight rows takes lanes_chunk (the same bits either way).
constexpr int kLanesFrom = 2;

// y[r * ldy + j] = lane j of acc[r] for the first nr rows.
template <int RB>
inline void store_rows(const __m256 (&acc)[RB], int nr, float* y, int64_t ldy) {
  for (int r = 0; r < RB; r++) {
    if (nr == kRowGroup) {
      _mm256_storeu_ps(y + r * ldy, acc[r]);
    } else {
      float lanes[kRowGroup];
      _mm256_storeu_ps(lanes, acc[r]);
      std::memcpy(y + r * ldy, lanes, nr * sizeof(float));
    }
  }
}

// The fp16 at rows[j] + offset for j < N (N <= 8) as words 0 .. N - 1: inserted one by one into a register (loads
// with the insert), for one conversion after. (Packed by shifts in 64-bit integers instead, the compiler vectorized
// the shifts: twice the vector operations.)
template <int N>
inline __m128i fp16_words(const uint8_t* const* rows, int64_t offset) {
  const auto d = [&](int j) {
    uint16_t v;
    std::memcpy(&v, rows[j] + offset, 2);
    return static_cast<int>(v);
  };
  __m128i v = _mm_cvtsi32_si128(d(0));
  v = _mm_insert_epi16(v, d(1), 1);
  v = _mm_insert_epi16(v, d(2), 2);
  v = _mm_insert_epi16(v, d(3), 3);
  if constexpr (N == 8) {
    v = _mm_insert_epi16(v, d(4), 4);
    v = _mm_insert_epi16(v, d(5), 5);
    v = _mm_insert_epi16(v, d(6), 6);
    v = _mm_insert_epi16(v, d(7), 7);
  }
  return v;
}

// The eight blocks' fp16 d at rows[j] + offset, as floats (lane j).
inline __m256 d8(const uint8_t* const* rows, int64_t offset) { return _mm256_cvtph_ps(fp16_words<8>(rows, offset)); }

// Bytes ahead of the rows being read that are prefetched (as gguf_decode.h: one sweep at the rows' pace).
constexpr int64_t kPrefetchAhead = 12288;

// One step of that sweep: the span bytes at ahead, into L1; returns where the next step starts.
inline const uint8_t* prefetch_span(const uint8_t* ahead, int64_t span) {
  for (int64_t o = 0; o < span; o += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
  return ahead + span;
}

// rows[j]: weight row j of the N from row (row_bytes apart); rows past nr repeat the last (their lanes are not
// stored).
template <int N>
inline void group_rows(const uint8_t* row, int64_t row_bytes, int nr, const uint8_t* (&rows)[N]) {
  for (int j = 0; j < N; j++) rows[j] = row + std::min(j, nr - 1) * row_bytes;
}

// Chunk c of eight nibble-format weight rows as codes_pair gives it: lo[k] and hi[k] hold rows k and k + 4.
template <int64_t Type>
inline void chunk_pairs(const uint8_t* const (&rows)[kRowGroup], int64_t c, __m256i (&lo)[4], __m256i (&hi)[4]) {
  constexpr int64_t kBytes = format_bytes(Type);
  for (int k = 0; k < 4; k++) codes_pair<Type>(rows[k] + c * kBytes, rows[k + 4] + c * kBytes, lo[k], hi[k]);
}

// y[r * ldy + j] (j < nr <= 8) for RB activation rows from m0 against nr weight rows (row_bytes apart) of a
// whole-chunk format, straight from the blocks; rows past nr repeat the last one (their lanes are not stored).
template <int64_t Type, int RB>
inline void decode_rows8(const uint8_t* row, int64_t row_bytes, int nr, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  constexpr int64_t kBytes = format_bytes(Type), span = kRowGroup * kBytes;
  const uint8_t* rows[kRowGroup];
  group_rows(row, row_bytes, nr, rows);
  const uint8_t* ahead = row + kPrefetchAhead;
  XRow xr[RB];
  x_rows(x, m0, xr);
  __m256 acc[RB];
  for (int r = 0; r < RB; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < x.K64 / kChunk32; c++) {
    ahead = prefetch_span(ahead, span);
    if constexpr (RB >= kLanesFrom && nibble_chunks<Type>()) {
      __m256i lo[4], hi[4];
      chunk_pairs<Type>(rows, c, lo, hi);
      lanes_chunk<Type, RB>(acc, [&](int k, int h) { return h == 0 ? lo[k] : hi[k]; }, d8(rows, c * kBytes), xr, c);
    } else if constexpr (nibble_chunks<Type>()) {
      const auto pair = [&](int k, __m256i& lo, __m256i& hi) {
        codes_pair<Type>(rows[k] + c * kBytes, rows[k + 4] + c * kBytes, lo, hi);
      };
      pairs_chunk<Type, RB>(acc, pair, d8(rows, c * kBytes), xr, c);
    } else {
      const auto codes = [&](int j) { return codes32<Type>(rows[j] + c * kBytes); };
      rows_chunk<Type, RB>(acc, codes, d8(rows, c * kBytes), xr, c);
    }
  }
  store_rows<RB>(acc, nr, y, ldy);
}

}  // namespace radixserve::gguf

#endif

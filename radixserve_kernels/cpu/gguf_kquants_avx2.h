// The K-quants Q4_K, Q5_K and Q6_K on AVX2 (no VNNI), at every row count (no tile form; a prefill's many rows read
// kquant_lanes8's super-blocks filled once, gguf_packed_avx2.h). The activations are rounded per 256 columns
// (QuantX.q256, as ggml's q8_K), so a weight row's whole super-block adds up in integers, exact: sum_j sc_j * sum(u *
// x) over its sub-blocks j (the integer scales sc in vpmaddwd), minus the zero point's share (Q6_K: 32 sc_j sum(x)) or
// apart from the minima's (Q4_K, Q5_K: m_j sum(x)), from the activations' sums per 16 columns (QuantX.sum16). Then one
// float step per weight row and super-block: acc += float(total) * (d * dx), the minima likewise into off with dmin,
// and y = acc - off at the row's end.
//
// Two forms with the same integers and the same float steps, so the same bits whatever the step's row count:
// - Up to kLanesFromK - 1 activation rows (`kquant_rows`): four or two weight rows side by side, each chunk's codes
//   straight into registers (`Reader`), eight int32 lanes of columns per weight and activation row, summed across
//   at the super-block's end (`row_sums4`: four rows' totals in one register, one float step for them).
// - From kLanesFromK on (`kquant_lanes8`): eight weight rows' super-block transposed once (`Lanes8`) so that lane j
//   is weight row j, as lanes_chunk does for Q4_0 and Q5_0: an activation row's four codes are one broadcast meeting
//   all eight rows, the int16 products of a scale's columns add before one vpmaddwd with the eight rows' scales, and
//   nothing is reduced across lanes (RESULTS.md, issue 38 session 39).
// Bounds (exact in int16 and int32): vpmaddubsw words at most 2 x 63 x 127 = 16002 (Q6_K; two add, 32004), 2 x 31 x
// 127 (Q5_K; a half sub-block's four add, 31496) or 2 x 15 x 127 (Q4_K; a sub-block's eight add, 30480); a
// super-block's total at most 16 x 128 x 16 x 63 x 127 (Q6_K, 2^28) and its zero point's share 32 x 16 x 128 x 16 x
// 127: below 2^31.
#pragma once

#include "gguf_activations.h"
#include "gguf_blocks.h"
#include "gguf_decode_avx2.h"

#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && !defined(RADIXSERVE_GGUF_VNNI)

namespace radixserve::gguf {

// Readers for the one-row form: `begin(s)` takes super-block s of the row (kWeights columns), `codes(c)` gives its
// 32-column chunk c as unpack_row would store the codes, `scales(c)` the int16 scale of each of the chunk's pairs of
// columns (vpmaddubsw's words: 0-7 columns 0-15, 8-15 columns 16-31), and `total` the super-block's integer sums
// with the zero point taken out (Q6_K) or the minima's sums apart (Q4_K, Q5_K: `mins`), eight lanes.
template <int64_t Type>
struct Reader;

// Q4_K and Q5_K: chunk c is sub-block c (w = d sc_c u - dmin m_c), the low (even c) or high nibbles of
// qs[32 (c / 2) ..]; Q5_K's fifth bits are bit c of qh[0..31].
template <int64_t Type>
struct MinReader {
  static constexpr int64_t kWeights = 256, kChunks = 8, kBytes = format_bytes(Type), kD = 0, kDmin = 2;
  static constexpr int64_t kQs = Type == kQ5_K ? 48 : 16;
  const uint8_t* row;
  const uint8_t* blk = nullptr;
  __m256i sc;   // the scales as int16 words 0-7 of both 128-bit halves (`scales` spreads word c)
  __m256i m16;  // m per 16 columns: m_0, m_0, m_1, m_1, .., m_7, m_7

  void begin(int64_t s) {
    blk = row + s * kBytes;
    const __m256i w = _mm256_cvtepu8_epi16(q4_k_scales128(blk));  // sc 0-7, m 0-7
    sc = _mm256_permute2x128_si256(w, w, 0x00);
    const __m128i m = _mm256_extracti128_si256(w, 1);
    m16 = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
  }
  __m256i codes(int c) const {
    const __m256i v = load32(blk + kQs + 32 * (c / 2));
    const __m256i nib = c % 2 == 0 ? low4(v) : high4(v);
    if constexpr (Type == kQ4_K) return nib;
    return _mm256_or_si256(nib, bit_to_16(load32(blk + 16), c));
  }
  __m256i scales(int c) const { return _mm256_shuffle_epi8(sc, _mm256_set1_epi16(static_cast<short>(0x0202 * c + 0x0100))); }
  __m256i total(__m256i isum, __m256i sums16, __m256i& mins) const {
    mins = _mm256_madd_epi16(m16, sums16);
    return isum;
  }
};

template <>
struct Reader<kQ4_K> : MinReader<kQ4_K> {};
template <>
struct Reader<kQ5_K> : MinReader<kQ5_K> {};

template <>
struct Reader<kQ6_K> {  // chunk c: half c / 4, part t = c % 4 of unpack_q6_k's four stores; scales 2c and 2c + 1
  static constexpr int64_t kWeights = 256, kChunks = 8, kBytes = format_bytes(kQ6_K), kD = 208, kDmin = -1;
  const uint8_t* row;
  const uint8_t* blk = nullptr;
  int16_t sc[16];

  void begin(int64_t s) {
    blk = row + s * kBytes;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
  }
  __m256i codes(int c) const {
    const int half = c / 4, t = c % 4;
    const __m256i l = load32(blk + 64 * half + (t % 2) * 32), h = load32(blk + 128 + 32 * half);
    const __m256i two = _mm256_set1_epi8(0x30);
    const __m256i nib = t < 2 ? low4(l) : high4(l);
    const __m256i hs = t == 0 ? _mm256_slli_epi16(h, 4) : t == 1 ? _mm256_slli_epi16(h, 2) : t == 2 ? h : _mm256_srli_epi16(h, 2);
    return _mm256_or_si256(nib, _mm256_and_si256(hs, two));
  }
  __m256i scales(int c) const {  // sc[2c] and sc[2c + 1] in every dword, then words 0-7 the first, 8-15 the second
    int32_t pair;
    std::memcpy(&pair, &sc[2 * c], 4);
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
                                            2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(_mm256_set1_epi32(pair), spread);
  }
  __m256i total(__m256i isum, __m256i sums16, __m256i&) const {  // sum_j sc_j sum(u x) - 32 sum_j sc_j sum(x)
    const __m256i zero = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)), sums16);
    return _mm256_sub_epi32(isum, _mm256_slli_epi32(zero, 5));
  }
};

// Lane j (0-3): the sum of the eight lanes of v[j] (integers: exact in any order; unpacks and adds as row_sums8).
inline __m128i row_sums4(const __m256i (&v)[4]) {
  const __m256i ab = pair_sums(v[0], v[1]), cd = pair_sums(v[2], v[3]);
  const __m256i q = _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
  return _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
}

// The four blocks' fp16 at rows[j] + offset, as floats (lane j).
inline __m128 fp16x4(const uint8_t* const* rows, int64_t offset) { return _mm_cvtph_ps(fp16_words<4>(rows, offset)); }

// Bytes ahead of the rows being read that both forms prefetch (prefetch_span; two threads, M = 1 and 8: 12 KB up to
// 6% slower, 48 KB 9-13%, a prefetch per row's super-block 30-40% at M = 1; RESULTS.md, issue 38 session 39).
constexpr int64_t kKquantAhead = 24576;

// Activation rows from which a pass takes kquant_lanes8 (the same bits either way): its transposes are per
// super-block, level with kquant_rows at about five rows (RESULTS.md, issue 38 session 39).
constexpr int kLanesFromK = 6;

// Weight rows side by side in kquant_rows: each activation row's sums take that many registers.
template <int RB>
constexpr int side_by_side() { return RB <= 2 ? 4 : 2; }

// y[r * ldy + j] (j < nr <= side_by_side) for RB activation rows from m0 against nr weight rows (row_bytes apart)
// from `row`; rows past nr repeat the last one (not stored).
template <int64_t Type, int RB>
inline void kquant_rows(const uint8_t* row, int64_t row_bytes, int nr, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  using R = Reader<Type>;
  constexpr int NR = side_by_side<RB>();
  constexpr int64_t span = NR * R::kBytes;  // bytes of the NR rows per super-block
  const uint8_t* ahead = row + kKquantAhead;
  const uint8_t* rows[4];  // row_sums4's four lanes; those past NR are not stored
  R w[NR];
  group_rows(row, row_bytes, nr, rows);
  for (int j = 0; j < NR; j++) w[j].row = rows[j];
  __m128 acc[RB], off[RB];
  for (int r = 0; r < RB; r++) acc[r] = off[r] = _mm_setzero_ps();
  for (int64_t s = 0; s < x.K64 / R::kWeights; s++) {
    for (int j = 0; j < NR; j++) w[j].begin(s);
    ahead = prefetch_span(ahead, span);
    __m256i isum[RB][4], mins[RB][4];
    for (int r = 0; r < RB; r++)
      for (int j = 0; j < 4; j++) isum[r][j] = mins[r][j] = _mm256_setzero_si256();
#pragma GCC unroll 8  // whole: each chunk's nibble half and shifts then known when compiled
    for (int c = 0; c < R::kChunks; c++) {
      __m256i xc[RB];
      for (int r = 0; r < RB; r++)
        xc[r] = load32(reinterpret_cast<const uint8_t*>(&x.q256[(m0 + r) * x.K64 + s * R::kWeights + c * kChunk32]));
      for (int j = 0; j < NR; j++) {
        const __m256i u = w[j].codes(c), sc = w[j].scales(c);
        for (int r = 0; r < RB; r++) {
          isum[r][j] = _mm256_add_epi32(isum[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xc[r]), sc));
          // Added here, else GCC computes all eight chunks' products first and spills them (RESULTS.md, session 39).
          asm("" : "+x"(isum[r][j]));
        }
      }
    }
    const int64_t at = s * R::kBytes;
    for (int r = 0; r < RB; r++) {
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x.sum16[(m0 + r) * x.K64 / kSub + s * 16]));
      for (int j = 0; j < NR; j++) isum[r][j] = w[j].total(isum[r][j], s16, mins[r][j]);
      const __m128 dx = _mm_set1_ps(x.d256[(m0 + r) * x.K64 / R::kWeights + s]);
      acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(row_sums4(isum[r])), _mm_mul_ps(fp16x4(rows, at + R::kD), dx), acc[r]);
      if constexpr (has_minima(Type))
        off[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(row_sums4(mins[r])), _mm_mul_ps(fp16x4(rows, at + R::kDmin), dx), off[r]);
    }
  }
  for (int r = 0; r < RB; r++) {
    float lanes[4];
    _mm_storeu_ps(lanes, _mm_sub_ps(acc[r], off[r]));
    std::memcpy(y + r * ldy, lanes, nr * sizeof(float));
  }
}

// Rows' 16 bytes at blk[j] + offset, transposed: t[g] lane j = row j's bytes 4g .. 4g + 3 (j < 8).
inline void transposed16(const uint8_t* const* blk, int64_t offset, __m256i (&t)[4]) {
  for (int k = 0; k < 4; k++)
    t[k] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(blk[k + 4] + offset),
                               reinterpret_cast<const __m128i*>(blk[k] + offset));
  transpose4(t[0], t[1], t[2], t[3]);
}

// A vpshufb index taking bytes b[0..3] of each dword into that dword's four bytes (-1: zero).
inline __m256i dword_index(int b0, int b1, int b2, int b3) {
  alignas(32) int32_t words[8];
  for (int i = 0; i < 8; i++) {
    uint32_t v = 0;
    const int b[4] = {b0, b1, b2, b3};
    for (int k = 0; k < 4; k++) v |= static_cast<uint32_t>(b[k] < 0 ? 0x80 : 4 * (i % 4) + b[k]) << (8 * k);
    words[i] = static_cast<int32_t>(v);
  }
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(words));
}

// The vpshufb indices a super-block's scales take (kquant_lanes8 makes them once, a static).
struct ScaleIndex {
  __m256i twice[4];   // byte b into both words, zero-extended (Q4_K's unsigned 6-bit scales and minima)
  __m256i high[4];    // byte b into both words' high bytes (Q6_K's int8 scales, sign-extended by a shift after)
  __m256i pairs[2];   // bytes 2p and 2p + 1 into the high bytes of the low and high word (Q6_K's zero point)
  ScaleIndex() {
    for (int b = 0; b < 4; b++) twice[b] = dword_index(b, -1, b, -1), high[b] = dword_index(-1, b, -1, b);
    for (int p = 0; p < 2; p++) pairs[p] = dword_index(-1, 2 * p, -1, 2 * p + 1);
  }
};

// The indices, made once for every caller.
inline const ScaleIndex& scale_index() {
  static const ScaleIndex index;
  return index;
}

// Eight weight rows' super-block with lane j holding row j (rows past the call's last repeat it): codes[c][h][g] the
// unsigned codes of chunk c, columns 16h + 4g .. 16h + 4g + 3; scale the int16 scale in both words (Q4_K, Q5_K: of
// sub-block c, scale[c]; Q6_K: of the 16 columns i, scale[i]); zero[p] the pair that meets dword p of the
// activations' sums per 16 (Q4_K, Q5_K: m_p twice, the minima; Q6_K: sc_2p, sc_2p+1, the zero point's share); d
// and dmin.
// Bytewise steps (nibbles, masks, 16-bit shifts whose spill is masked off) commute with the dword transposes, so
// the codes are the Reader's, transposed.
template <int64_t Type>
struct Lanes8;

// Q4_K and Q5_K (Q5_K's fifth bits: bit c of the qh bytes, transposed as the codes are).
template <int64_t Type>
struct MinLanes8 {
  static constexpr int64_t kBytes = format_bytes(Type), kQs = MinReader<Type>::kQs;
  __m256i codes[8][2][4], scale[8], zero[8];
  __m256 d, dmin;

  void fill(const uint8_t* const* blk, const ScaleIndex& index) {
    __m256i h[4];  // h[0]: (d, dmin); h[1..3]: the 12 bytes of scales and minima, as q4_k_scales's w[0..2]
    transposed16(blk, 0, h);
    const __m256i low6 = _mm256_set1_epi8(0x3f), nibble = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x03);
    const auto top = [&](__m256i v) { return _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 6), top2), 4); };
    const __m256i w[4] = {_mm256_and_si256(h[1], low6), _mm256_or_si256(_mm256_and_si256(h[3], nibble), top(h[1])),
                          _mm256_and_si256(h[2], low6),
                          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(h[3], 4), nibble), top(h[2]))};
    for (int c = 0; c < 8; c++) {
      scale[c] = _mm256_shuffle_epi8(w[c / 4], index.twice[c % 4]);
      zero[c] = _mm256_shuffle_epi8(w[2 + c / 4], index.twice[c % 4]);
    }
    // [d of rows 0-3, dmin 0-3 | d 4-7, dmin 4-7] as words, then quadwords 0, 2, 1, 3: d of 0-7, dmin of 0-7
    const __m256i halves = _mm256_packus_epi32(_mm256_and_si256(h[0], _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(h[0], 16));
    const __m256i ordered = _mm256_permute4x64_epi64(halves, _MM_SHUFFLE(3, 1, 2, 0));
    d = _mm256_cvtph_ps(_mm256_castsi256_si128(ordered));
    dmin = _mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1));
    __m256i qh[2][4];  // Q5_K: the qh bytes of columns 16 hh .. 16 hh + 15, transposed
    if constexpr (Type == kQ5_K)
      for (int hh = 0; hh < 2; hh++) transposed16(blk, 16 + 16 * hh, qh[hh]);
    for (int p = 0; p < 4; p++)
      for (int hh = 0; hh < 2; hh++) {
        __m256i raw[4];
        transposed16(blk, kQs + 32 * p + 16 * hh, raw);
        for (int g = 0; g < 4; g++) {
          codes[2 * p][hh][g] = low4(raw[g]), codes[2 * p + 1][hh][g] = high4(raw[g]);
          if constexpr (Type == kQ5_K)
            for (int k = 0; k < 2; k++)
              codes[2 * p + k][hh][g] = _mm256_or_si256(codes[2 * p + k][hh][g], bit_to_16(qh[hh][g], 2 * p + k));
        }
      }
  }
};

template <>
struct Lanes8<kQ4_K> : MinLanes8<kQ4_K> {};
template <>
struct Lanes8<kQ5_K> : MinLanes8<kQ5_K> {};

template <>
struct Lanes8<kQ6_K> {
  static constexpr int64_t kBytes = format_bytes(kQ6_K);
  __m256i codes[8][2][4], scale[16], zero[8];
  __m256 d, dmin;

  void fill(const uint8_t* const* blk, const ScaleIndex& index) {
    __m256i sc[4];  // int8 scales 4w .. 4w + 3
    transposed16(blk, 192, sc);
    for (int i = 0; i < 16; i++) scale[i] = _mm256_srai_epi16(_mm256_shuffle_epi8(sc[i / 4], index.high[i % 4]), 8);
    for (int p = 0; p < 8; p++) zero[p] = _mm256_srai_epi16(_mm256_shuffle_epi8(sc[p / 2], index.pairs[p % 2]), 8);
    d = d8(blk, 208);
    dmin = _mm256_setzero_ps();
    const __m256i two = _mm256_set1_epi8(0x30);
    const auto high2 = [&](__m256i v) { return _mm256_and_si256(v, two); };
    for (int half = 0; half < 2; half++)
      for (int hh = 0; hh < 2; hh++) {
        __m256i l0[4], l1[4], h[4];  // Reader<kQ6_K>::codes's l for t = 0, 2 and 1, 3; its h
        transposed16(blk, 64 * half + 16 * hh, l0);
        transposed16(blk, 64 * half + 32 + 16 * hh, l1);
        transposed16(blk, 128 + 32 * half + 16 * hh, h);
        const int c = 4 * half;
        for (int g = 0; g < 4; g++) {
          codes[c][hh][g] = _mm256_or_si256(low4(l0[g]), high2(_mm256_slli_epi16(h[g], 4)));
          codes[c + 1][hh][g] = _mm256_or_si256(low4(l1[g]), high2(_mm256_slli_epi16(h[g], 2)));
          codes[c + 2][hh][g] = _mm256_or_si256(high4(l0[g]), high2(h[g]));
          codes[c + 3][hh][g] = _mm256_or_si256(high4(l1[g]), high2(_mm256_srli_epi16(h[g], 2)));
        }
      }
  }
};

// sb filled with super-block s of the eight weight rows at rows.
template <typename L>
inline void fill_super_block(L& sb, const uint8_t* const (&rows)[kRowGroup], int64_t s, const ScaleIndex& index) {
  const uint8_t* blk[kRowGroup];
  for (int j = 0; j < kRowGroup; j++) blk[j] = rows[j] + s * L::kBytes;
  sb.fill(blk, index);
}

// Lane j: row j's int16 words for 16 columns (t: codes[c][h]) against one activation row's 16 codes at xq: pairs
// of vpmaddubsw added, groups (0, 1) into lo and (2, 3) into hi (each at most 2 x 16002).
inline void lanes16_words(const __m256i (&t)[4], const int8_t* xq, __m256i& lo, __m256i& hi) {
  lo = _mm256_add_epi16(_mm256_maddubs_epi16(t[0], codes4(xq, 0)), _mm256_maddubs_epi16(t[1], codes4(xq, 1)));
  hi = _mm256_add_epi16(_mm256_maddubs_epi16(t[2], codes4(xq, 2)), _mm256_maddubs_epi16(t[3], codes4(xq, 3)));
}

// acc[r] and off[r] (the minima's share, Q4_K and Q5_K) of RB activation rows xq[r] plus super-block s of eight
// weight rows, filled into sb: per sub-block the int16 products, one vpmaddwd with the eight rows' scales, then the
// zero point's or the minima's share from the activations' sums per 16 columns (sums[r]), and one float step.
template <int64_t Type, int RB>
inline void lanes8_step(const Lanes8<Type>& sb, const int8_t* const (&xq)[RB], const int16_t* const (&sums)[RB],
                        const QuantX& x, int64_t m0, int64_t s, __m256 (&acc)[RB], __m256 (&off)[RB]) {
  constexpr int64_t kWeights = 256;
  __m256i isum[RB];
  for (int r = 0; r < RB; r++) isum[r] = _mm256_setzero_si256();
  for (int c = 0; c < 8; c++) {
    __m256i words[RB];  // Q4_K: the sub-block's int16 sums, both halves (eight vpmaddubsw, at most 30480)
    for (int hh = 0; hh < 2; hh++)
      for (int r = 0; r < RB; r++) {
        __m256i lo, hi;
        lanes16_words(sb.codes[c][hh], xq[r] + s * kWeights + c * kChunk32 + 16 * hh, lo, hi);
        if constexpr (Type == kQ4_K) {
          const __m256i v = _mm256_add_epi16(lo, hi);
          words[r] = hh == 0 ? v : _mm256_add_epi16(words[r], v);
        } else if constexpr (Type == kQ5_K) {  // a half's four vpmaddubsw (at most 31496), a vpmaddwd each half
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_add_epi16(lo, hi), sb.scale[c]));
        } else {
          const __m256i sc = sb.scale[2 * c + hh];
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(lo, sc), _mm256_madd_epi16(hi, sc)));
        }
      }
    if constexpr (Type == kQ4_K)
      for (int r = 0; r < RB; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(words[r], sb.scale[c]));
  }
  for (int r = 0; r < RB; r++) {
    __m256i z = _mm256_setzero_si256();
    for (int p = 0; p < 8; p++) {
      int32_t pair;  // the sums of columns 32p .. 32p + 15 and 32p + 16 .. 32p + 31
      std::memcpy(&pair, sums[r] + s * 16 + 2 * p, 4);
      z = _mm256_add_epi32(z, _mm256_madd_epi16(sb.zero[p], _mm256_set1_epi32(pair)));
    }
    const __m256 dx = _mm256_set1_ps(x.d256[(m0 + r) * x.K64 / kWeights + s]);
    if constexpr (Type == kQ6_K) isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(z, 5));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(sb.d, dx), acc[r]);
    if constexpr (has_minima(Type)) off[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(z), _mm256_mul_ps(sb.dmin, dx), off[r]);
  }
}

// The activation rows from m0 as lanes8_step reads them: codes and sums per 16 columns.
template <int RB>
inline void lanes8_rows(const QuantX& x, int64_t m0, const int8_t* (&xq)[RB], const int16_t* (&sums)[RB]) {
  for (int r = 0; r < RB; r++) xq[r] = &x.q256[(m0 + r) * x.K64], sums[r] = &x.sum16[(m0 + r) * x.K64 / kSub];
}

// y[r * ldy + j] (j < nr <= 8) for RB activation rows from m0 against nr weight rows (row_bytes apart) from `row`,
// each super-block filled as it comes.
template <int64_t Type, int RB>
inline void kquant_lanes8(const uint8_t* row, int64_t row_bytes, int nr, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  using L = Lanes8<Type>;
  constexpr int64_t span = kRowGroup * L::kBytes;
  const ScaleIndex& index = scale_index();
  const uint8_t* ahead = row + kKquantAhead;
  const uint8_t* rows[kRowGroup];
  group_rows(row, row_bytes, nr, rows);
  const int8_t* xq[RB];
  const int16_t* sums[RB];
  lanes8_rows(x, m0, xq, sums);
  __m256 acc[RB], off[RB];
  for (int r = 0; r < RB; r++) acc[r] = off[r] = _mm256_setzero_ps();
  L sb;
  for (int64_t s = 0; s < x.K64 / 256; s++) {
    ahead = prefetch_span(ahead, span);
    fill_super_block(sb, rows, s, index);
    lanes8_step<Type, RB>(sb, xq, sums, x, m0, s, acc, off);
  }
  for (int r = 0; r < RB; r++) acc[r] = _mm256_sub_ps(acc[r], off[r]);
  store_rows<RB>(acc, nr, y, ldy);
}

}  // namespace radixserve::gguf

#endif

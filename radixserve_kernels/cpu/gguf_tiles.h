// The GGUF linears' dot products over weight rows already unpacked (a tile, gguf_blocks.h) and, for decode steps,
// straight from the blocks (gguf_decode.h, gguf_decode_avx2.h): what gguf_linear.cpp runs for each tile of weight
// rows. Every path runs the same sequence of operations per (activation row, weight row) pair, so a row's result
// does not depend on the path (see gguf_linear.cpp, "Batch invariance").
#pragma once

#include "gguf_activations.h"
#include "gguf_blocks.h"
#include "gguf_decode.h"
#include "gguf_decode32.h"
#include "gguf_decode_avx2.h"
#include "gguf_kquants_avx2.h"
#include "gguf_packed_avx2.h"
#include "transpose16.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace radixserve::gguf {


constexpr int64_t kRowBlock = 4;  // activation rows sharing one load of the codes

// One weight row unpacked (gguf_blocks.h), padded like the activations.
struct RowView {
  const uint8_t* u;
  const float* a;
  const float* b;
};

// sum_j b[j] * corr[j]: the offsets' share of a row's dot product (S is a multiple of 16).
inline float offsets(const float* b, const float* corr, int64_t S) {
#if defined(RADIXSERVE_GGUF_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < S; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(b + j), _mm512_loadu_ps(corr + j), acc);
  return _mm512_reduce_add_ps(acc);
#else  // (AVX2 builds sum their offsets in gguf_decode_avx2.h, in the order its decode rows use)
  float acc = 0.f;
  for (int64_t j = 0; j < S; j++) acc += b[j] * corr[j];
  return acc;
#endif
}

#if defined(RADIXSERVE_GGUF_VNNI)

// A tile repacked for its kernel: per 4-column group g of the rows (K64 / 4 of them), the 16 weight rows' 4 codes
// side by side, one register whose lanes are weight rows; per sub-block of 16 columns, the 16 rows' a. Rows past the
// tile's own are zero (their results are not stored). One vpdpbusd then serves 16 pairs, and a sub-block's float
// step (sub_step) 16 pairs; the decode rows' layout holds 4 weight rows x 4 sub-blocks (gguf_decode.h, by_group).
struct PackedTile {
  std::vector<uint32_t> u;  // [K64 / 4][16]
  std::vector<float> a;     // [S][16]
  std::vector<uint8_t> zeros;  // the rows past the tile's own

  void pack(const RowView* w, int64_t rows, const QuantX& x) {
    const int64_t subs = x.K64 / kSub;
    u.resize(x.K64 / 4 * 16);
    a.resize(x.S * 16);  // S: subs padded to 16, what the transposes write
    if (rows < 16) zeros.assign(std::max<int64_t>(x.K64, 4 * x.S), 0);  // read only for the missing rows
    const void* cu[16];
    const void* ca[16];
    for (int64_t r = 0; r < 16; r++) {
      cu[r] = r < rows ? static_cast<const void*>(w[r].u) : zeros.data();
      ca[r] = r < rows ? static_cast<const void*>(w[r].a) : zeros.data();
    }
    for (int64_t c = 0; c < x.K64 / kChunk; c++) simd::transpose16(cu, 64 * c, &u[c * 256]);
    for (int64_t sb = 0; sb < subs; sb += 16) simd::transpose16(ca, 4 * sb, &a[sb * 16]);
  }
};

// acc plus, per lane, the dot product of w's 4 unsigned codes with the 4 signed codes at p, broadcast: one vpdpbusd
// with p as its {1to16} memory operand. Written out because GCC turns _mm512_set1_epi32 of the loaded codes into a
// vpbroadcastd of its own (or, from a copy of a step's codes into a local array, a 64-bit load, a shift and a
// broadcast from a general register), which bounded the tiles: with both changes below, the prefill linears of the
// default model ran 1.22-1.28x faster at 96 and 512 rows (RESULTS.md, issue 38 session 49). The emulated build
// (tests only) keeps the intrinsic.
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t* p) {
#if defined(RADIXSERVE_GGUF_EMULATE_VNNI)
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(v));
#else
  typedef int32_t __attribute__((may_alias)) Codes4;  // int8 codes read as one word
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const Codes4*>(p)));
  return acc;
#endif
}

// The tile's 16 weight rows against RB activation rows from m0: total[r] lane j is pair (m0 + r, j)'s sum before
// offsets. Per pair, the same integers and `sub_step`s as the decode rows, the same order of the final sum: per 16
// columns as decode_rows (gguf_decode.h), or with PerBlock (the 32-weight formats) per block of 32 as decode_rows32
// (gguf_decode32.h), the block's a (its d: both its 16-column entries) times its activations' scale.
template <int RB, int Shift, bool PerBlock>
inline void tile_rows(const PackedTile& t, const QuantX& x, int64_t m0, __m512* total) {
  constexpr int64_t kCols = PerBlock ? kXBlock : kSub, kGroups = kCols / 4;  // columns per float step, their groups
  __m512 acc[RB][4];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  // Step s into accumulator k = s % 4, k a constant: the accumulators stay in registers (a k the compiler could not
  // resolve kept them in memory, a load and a store per float step).
  const auto step = [&](auto kc, int64_t s) {
    constexpr int k = decltype(kc)::value;
    const int64_t sub = s * kCols / kSub;  // the step's first 16-column entry
    __m512i w[kGroups];
    for (int g = 0; g < kGroups; g++) w[g] = _mm512_loadu_si512(&t.u[(kGroups * s + g) * 16]);
    const __m512 a = _mm512_loadu_ps(&t.a[sub * 16]);
    for (int r = 0; r < RB; r++) {
      const int64_t m = m0 + r;
      __m512i sums = _mm512_setzero_si512();
      if constexpr (Shift >= 0) {
        const int32_t nsum = PerBlock ? x.nsum32[m * x.K64 / kXBlock + s] : x.nsum16[m * x.S + s];
        sums = _mm512_slli_epi32(_mm512_set1_epi32(nsum), Shift);
      }
      const int8_t* q = &x.q[m * x.K64 + s * kCols];
      for (int g = 0; g < kGroups; g++) sums = dpbusd_broadcast(sums, w[g], q + 4 * g);
      acc[r][k] = sub_step(acc[r][k], sums, a, _mm512_set1_ps(x.scale16[m * x.S + sub]));
    }
  };
  const int64_t steps = x.K64 / kCols;
  int64_t s = 0;
  for (; s + 4 <= steps; s += 4) {
    step(std::integral_constant<int, 0>{}, s);
    step(std::integral_constant<int, 1>{}, s + 1);
    step(std::integral_constant<int, 2>{}, s + 2);
    step(std::integral_constant<int, 3>{}, s + 3);
  }
  if (s < steps) step(std::integral_constant<int, 0>{}, s);
  if (s + 1 < steps) step(std::integral_constant<int, 1>{}, s + 1);
  if (s + 2 < steps) step(std::integral_constant<int, 2>{}, s + 2);
  for (int r = 0; r < RB; r++)
    total[r] = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][2]), _mm512_add_ps(acc[r][1], acc[r][3]));
}

template <int RB, int Shift, bool PerBlock>
inline void tile_store(const PackedTile& t, const RowView* w, int64_t rows, const QuantX& x, int64_t m0, float* y,
                       int64_t ldy) {
  __m512 total[RB];
  tile_rows<RB, Shift, PerBlock>(t, x, m0, total);
  for (int r = 0; r < RB; r++) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, total[r]);
    for (int64_t j = 0; j < rows; j++) {
      y[r * ldy + j] = lanes[j];
      if constexpr (Shift < 0) y[r * ldy + j] -= offsets(w[j].b, &x.corr[(m0 + r) * x.S], x.S);
    }
  }
}

// Every activation row against `rows` (<= 16) unpacked weight rows (a tile), kRowBlock activation rows at a time.
template <int Shift, bool PerBlock>
void dot_tile(const RowView* w, int64_t rows, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  thread_local PackedTile t;
  t.pack(w, rows, x);
  int64_t m = 0;
  for (; m + kRowBlock <= M; m += kRowBlock) tile_store<kRowBlock, Shift, PerBlock>(t, w, rows, x, m, y + m * ldy, ldy);
  for (; m < M; m++) tile_store<1, Shift, PerBlock>(t, w, rows, x, m, y + m * ldy, ldy);
}

inline void dot_tile(int64_t type, const RowView* w, int64_t rows, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  switch (type) {
    case kQ4_0: return dot_tile<zero_shift(kQ4_0), true>(w, rows, x, M, y, ldy);
    case kQ5_0: return dot_tile<zero_shift(kQ5_0), true>(w, rows, x, M, y, ldy);
    case kQ8_0: return dot_tile<zero_shift(kQ8_0), true>(w, rows, x, M, y, ldy);
    case kQ6_K: return dot_tile<zero_shift(kQ6_K), false>(w, rows, x, M, y, ldy);
    default: return dot_tile<-1, false>(w, rows, x, M, y, ldy);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)

// No VNNI: gguf_decode_avx2.h, 32 columns a step; the tiles run the sequence of its decode rows, eight weight rows a
// register (`tile_rows8`). They serve Q8_0, and Q4_0 and Q5_0 only where K is not a multiple of 64: otherwise those
// and the K-quants take their decode rows or the packed rows at every row count (fused()).

// Q4_0, Q5_0, Q8_0: eight weight rows (rows past nr repeat the last) against RB activation rows from m0, the
// sequence of decode_rows8 (gguf_decode_avx2.h) per pair.
template <int64_t Type, int RB>
inline void tile_rows8(const RowView* w, int nr, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  const RowView* v[kRowGroup];
  for (int j = 0; j < kRowGroup; j++) v[j] = &w[std::min(j, nr - 1)];
  XRow xr[RB];
  x_rows(x, m0, xr);
  __m256 acc[RB];
  for (int r = 0; r < RB; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < x.K64 / kChunk32; c++) {
    const __m256 a = _mm256_setr_ps(v[0]->a[2 * c], v[1]->a[2 * c], v[2]->a[2 * c], v[3]->a[2 * c], v[4]->a[2 * c],
                                    v[5]->a[2 * c], v[6]->a[2 * c], v[7]->a[2 * c]);
    const auto half = [&](int j, int h) { return reinterpret_cast<const __m128i*>(v[j]->u + c * kChunk32 + 16 * h); };
    if constexpr (RB >= kLanesFrom && nibble_chunks<Type>()) {
      lanes_chunk<Type, RB>(acc, [&](int k, int h) { return _mm256_loadu2_m128i(half(k + 4, h), half(k, h)); }, a, xr, c);
    } else if constexpr (nibble_chunks<Type>()) {  // the codes are under 32, so the decode rows' pairs apply (fewer ops)
      const auto pair = [&](int k, __m256i& lo, __m256i& hi) {
        lo = _mm256_loadu2_m128i(half(k + 4, 0), half(k, 0));
        hi = _mm256_loadu2_m128i(half(k + 4, 1), half(k, 1));
      };
      pairs_chunk<Type, RB>(acc, pair, a, xr, c);
    } else {
      const auto codes = [&](int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[j]->u + c * kChunk32)); };
      rows_chunk<Type, RB>(acc, codes, a, xr, c);
    }
  }
  store_rows<RB>(acc, nr, y, ldy);
}

template <int64_t Type>
void dot_tile(const RowView* w, int64_t rows, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; r += kRowGroup) {
    const int nr = static_cast<int>(std::min<int64_t>(kRowGroup, rows - r));
    int64_t m = 0;
    for (; m + kRowBlock <= M; m += kRowBlock) tile_rows8<Type, kRowBlock>(w + r, nr, x, m, y + m * ldy + r, ldy);
    for (; m < M; m++) tile_rows8<Type, 1>(w + r, nr, x, m, y + m * ldy + r, ldy);
  }
}

inline void dot_tile(int64_t type, const RowView* w, int64_t rows, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  switch (type) {
    case kQ4_0: return dot_tile<kQ4_0>(w, rows, x, M, y, ldy);
    case kQ5_0: return dot_tile<kQ5_0>(w, rows, x, M, y, ldy);
    case kQ8_0: return dot_tile<kQ8_0>(w, rows, x, M, y, ldy);
    default: TORCH_CHECK(false, "block type ", type, " has no AVX2 tile: it runs its decode rows (fused)");
  }
}

#else

template <int RB>
inline void dot_rows(const RowView& w, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  for (int r = 0; r < RB; r++) {
    const int64_t m = m0 + r;
    float acc = 0.f;
    for (int64_t j = 0; j < x.K64 / kSub; j++) {
      int32_t dot = 0;
      for (int64_t l = 0; l < kSub; l++) dot += w.u[j * kSub + l] * x.q[m * x.K64 + j * kSub + l];
      acc += static_cast<float>(dot) * (w.a[j] * x.scale16[m * x.S + j]);
    }
    y[r * ldy] = acc - offsets(w.b, &x.corr[m * x.S], x.S);
  }
}

#endif

#if defined(RADIXSERVE_GGUF_VNNI) || (defined(__AVX2__) && defined(__FMA__))

// Decode (up to kFusedRows rows): gguf_decode.h (VNNI) or gguf_decode_avx2.h (AVX2), the blocks straight into
// registers, activation rows decode_block() at a time over the same weights (which the earlier pass left in L1/L2). On
// VNNI four weight rows run side by side (their pairs make one register of sub-block sums; 6-8 activation rows take
// two such groups a pass, see fused_rows); on AVX2, eight a pass
// (one activation row of a K-quant: four). Measured
// (benchmarks.gguf_linear, one thread, all layers; RESULTS.md, issue 38 session 17): on VNNI the decode path beats
// the packed tiles up to 8 rows (gate_up 32-33 vs 39-40 ms at 8), is level at 12 and behind at 16 (gate_up 64 vs
// 56-57 ms); on AVX2 the decode path at 9-16 rows was slower than its tiles. Each pair runs the same sequence either
// way: the same bits.
#if defined(RADIXSERVE_GGUF_VNNI)
constexpr int64_t kFusedRows = 12;
#else
constexpr int64_t kFusedRows = 8;
#endif
// On AVX2, Q4_0, Q5_0 and the K-quants at any row count: past kFusedRows packed once (gguf_packed_avx2.h; the
// K-quants' integer super-block sums have no tile form).
inline bool fused(int64_t type, int64_t M, int64_t K) {
  return (M <= kFusedRows || packs_rows(type)) && K % kChunk == 0;
}

template <int64_t Type, int RB>
void fused_rows(const uint8_t* row, int64_t row_bytes, int64_t rows, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
#if defined(RADIXSERVE_GGUF_VNNI)
  // Eight weight rows a pass (two groups of four: G = 2 in gguf_decode.h and gguf_decode32.h) while more than four
  // are left, at six or more activation rows, where the activations' loads and broadcasts that the groups share
  // outweigh the extra rows streaming side by side. Measured from memory at two threads (benchmarks.gguf_linear --threads 2 --wall
  // --huge-pages, benchmarks.decode_ab; RESULTS.md, issue 38 sessions 45-47): at eight rows gate_up 10.0-10.2 against
  // 12.2-12.6 ms, down 7.0-7.5 against 7.3-8.0; at 2-4 rows mixed (gate_up 5.45 against 5.71-6.04 ms at 2, 7.85-7.92
  // against 7.51-7.54 at 4); at one row it paid before the weight rows were transposed by group (whole steps
  // 1.04-1.07x), not after (four a pass: 1.017x and 1.026x). Q8_0 (the LM head) keeps four at every row count: eight
  // read it slower at 2-4 rows (5.1-5.8 against 4.0-4.4 ms) and no faster at eight; with one float step per block
  // (gguf_decode32.h, session 48) slower at six and eight too (8 rows: 6.4-6.6 against 5.8-5.9 ms).
  constexpr int G = Type != kQ8_0 && RB >= 6 ? 2 : 1;
  const bool long_rows = x.K64 > kLongRow;  // the prefetch distance is in the template: a branch cost 6% in-cache
  const auto pass = [&](auto long_rows_c, auto g_c, const uint8_t* w, int nr, float* yr) {
    if constexpr (is_block32(Type))
      decode_rows32<Type, RB, long_rows_c.value, g_c.value>(w, row_bytes, nr, x, m0, yr, ldy);
    else
      decode_rows<Type, RB, long_rows_c.value, g_c.value>(w, row_bytes, nr, x, m0, yr, ldy);
  };
  using Long = std::true_type;
  using Short = std::false_type;
  using Wide = std::integral_constant<int, G>;
  using Four = std::integral_constant<int, 1>;
  for (int64_t r = 0; r < rows;) {
    const int nr = static_cast<int>(std::min<int64_t>(4 * G, rows - r));
    const uint8_t* w = row + r * row_bytes;
    if (long_rows && nr > 4)
      pass(Long{}, Wide{}, w, nr, y + r);
    else if (long_rows)
      pass(Long{}, Four{}, w, nr, y + r);
    else if (nr > 4)
      pass(Short{}, Wide{}, w, nr, y + r);
    else
      pass(Short{}, Four{}, w, nr, y + r);
    r += nr;
  }
#else
  if constexpr (whole_chunks<Type>()) {
    for (int64_t r = 0; r < rows; r += kRowGroup) {
      const int nr = static_cast<int>(std::min<int64_t>(kRowGroup, rows - r));
      decode_rows8<Type, RB>(row + r * row_bytes, row_bytes, nr, x, m0, y + r, ldy);
    }
  } else if constexpr (RB < kLanesFromK) {
    constexpr int NR = side_by_side<RB>();
    for (int64_t r = 0; r < rows; r += NR) {
      const int nr = static_cast<int>(std::min<int64_t>(NR, rows - r));
      kquant_rows<Type, RB>(row + r * row_bytes, row_bytes, nr, x, m0, y + r, ldy);
    }
  } else {
    for (int64_t r = 0; r < rows; r += kRowGroup) {
      const int nr = static_cast<int>(std::min<int64_t>(kRowGroup, rows - r));
      kquant_lanes8<Type, RB>(row + r * row_bytes, row_bytes, nr, x, m0, y + r, ldy);
    }
  }
#endif
}

#if defined(RADIXSERVE_GGUF_VNNI)
// Activation rows a decode pass takes over the same weights: 8 share each unpacked chunk of 4 (or 8) weight rows.
// Q4_K's and Q5_K's offsets take a register per (activation row, weight row), so 8 rows spill some of them; they
// kept 4 until 8 measured faster anyway (one thread from the caches, layer 2's Q4_K down: 0.473 against 0.52-0.57 ms
// in two passes of 4; from memory at two threads, all layers' down: 6.6-6.8 against 7.2-7.7 ms; RESULTS.md, issue 38
// session 47).
template <int64_t Type>
constexpr int64_t decode_block() { return 8; }
#else
// Q4_0, Q5_0 and the K-quants: eight activation rows in one pass (lanes_chunk, gguf_decode_avx2.h, and kquant_lanes8,
// gguf_kquants_avx2.h: the eight weight rows' codes and their transposes are made once for them all); Q8_0 keeps 4
// (its registers).
template <int64_t Type>
constexpr int64_t decode_block() { return Type == kQ8_0 ? kRowBlock : kFusedRows; }
#endif

template <int64_t Type>
void fused_rows(const uint8_t* row, int64_t row_bytes, int64_t rows, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  if constexpr (packs_rows(Type))
    if (M > kFusedRows) return packed_rows<Type>(row, row_bytes, rows, x, M, y, ldy);
  constexpr int64_t B = decode_block<Type>();
  for (int64_t m0 = 0; m0 < M; m0 += B) {
    float* ym = y + m0 * ldy;
    const auto pass = [&](auto rb) {  // only the row counts this format's passes take are compiled
      if constexpr (rb.value <= B) fused_rows<Type, rb.value>(row, row_bytes, rows, x, m0, ym, ldy);
    };
    with_count(std::min(M - m0, B), pass);
  }
}

// `rows` weight rows from `row` against all M activation rows (more than kFusedRows: the packed formats only).
inline void fused_rows(int64_t type, const uint8_t* row, int64_t row_bytes, int64_t rows, const QuantX& x, int64_t M,
                       float* y, int64_t ldy) {
  switch (type) {
    case kQ4_0: return fused_rows<kQ4_0>(row, row_bytes, rows, x, M, y, ldy);
    case kQ5_0: return fused_rows<kQ5_0>(row, row_bytes, rows, x, M, y, ldy);
    case kQ8_0: return fused_rows<kQ8_0>(row, row_bytes, rows, x, M, y, ldy);
    case kQ4_K: return fused_rows<kQ4_K>(row, row_bytes, rows, x, M, y, ldy);
    case kQ5_K: return fused_rows<kQ5_K>(row, row_bytes, rows, x, M, y, ldy);
    default: return fused_rows<kQ6_K>(row, row_bytes, rows, x, M, y, ldy);
  }
}

#else
// Plain C++: every call takes the tiles (correct, not tuned).
inline bool fused(int64_t, int64_t, int64_t) { return false; }
inline void fused_rows(int64_t, const uint8_t*, int64_t, int64_t, const QuantX&, int64_t, float*, int64_t) {}

inline void dot_tile(int64_t, const RowView* w, int64_t rows, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; r++) {
    int64_t m = 0;
    for (; m + kRowBlock <= M; m += kRowBlock) dot_rows<kRowBlock>(w[r], x, m, y + m * ldy + r, ldy);
    for (; m < M; m++) dot_rows<1>(w[r], x, m, y + m * ldy + r, ldy);
  }
}
#endif

}  // namespace radixserve::gguf

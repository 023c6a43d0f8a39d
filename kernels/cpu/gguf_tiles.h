// The GGUF linears' dot products over weight rows already unpacked (a tile, gguf_blocks.h) and, for decode steps,
// straight from the blocks (gguf_decode.h, gguf_decode_avx2.h): what gguf_linear.cpp runs for each tile of weight
// rows. Every path runs the same sequence of operations per (activation row, weight row) pair, so a row's result
// does not depend on the path (see gguf_linear.cpp, "Batch invariance").
#pragma once

#include "gguf_activations.h"
#include "gguf_blocks.h"
#include "gguf_decode.h"
#include "gguf_decode_avx2.h"

#include <algorithm>
#include <cstdint>

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
#if defined(__AVX512F__)
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

// One 64-column chunk c of one weight row (codes u, a per 16 in a4) into the accumulators of RB activation rows.
// The fused decode below and the tiles run this same sequence, so their results are equal bit for bit.
template <int RB, int Shift>
inline void chunk(__m512i u, __m128 a4, const QuantX& x, int64_t m0, int64_t c, __m512* acc) {
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // a per 16 -> lanes
  const __m512 a = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(a4));
  for (int r = 0; r < RB; r++) {
    const int64_t m = m0 + r;
    __m512i dot = _mm512_setzero_si512();
    if constexpr (Shift >= 0) dot = _mm512_slli_epi32(_mm512_loadu_si512(&x.nsum4[m * x.K64 / 4 + c * 16]), Shift);
    acc[r] = step(acc[r], dot, u, _mm512_loadu_si512(&x.q[m * x.K64 + c * kChunk]), a,
                  _mm512_loadu_ps(&x.lane[m * x.K64 / 4 + c * 16]));
  }
}

template <int RB, int Shift>
inline void finish(const __m512* acc, const float* b, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  for (int r = 0; r < RB; r++) {
    y[r * ldy] = _mm512_reduce_add_ps(acc[r]);
    if constexpr (Shift < 0) y[r * ldy] -= offsets(b, &x.corr[(m0 + r) * x.S], x.S);
  }
}

// y[r] for RB activation rows starting at m0 against one unpacked weight row.
template <int RB, int Shift>
inline void dot_rows(const RowView& w, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  __m512 acc[RB];
  for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < x.K64 / kChunk; c++)
    chunk<RB, Shift>(_mm512_loadu_si512(w.u + c * kChunk), _mm_loadu_ps(w.a + c * 4), x, m0, c, acc);
  finish<RB, Shift>(acc, w.b, x, m0, y, ldy);
}

template <int Shift>
void dot_all(const RowView& w, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kRowBlock <= M; m += kRowBlock) dot_rows<kRowBlock, Shift>(w, x, m, y + m * ldy, ldy);
  for (; m < M; m++) dot_rows<1, Shift>(w, x, m, y + m * ldy, ldy);
}

// 4 weight rows x 2 activation rows in registers: each activation load serves 4 weight rows, each code load 2
// activation rows (prefill was bound by reloading the activations' codes, scales and sums for every weight row).
// Every (activation row, weight row) pair runs `chunk`'s sequence, so the result is the same as one at a time.
template <int Shift>
inline void dot_4x2(const RowView* w, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[2][4];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t c = 0; c < x.K64 / kChunk; c++) {
    __m512i u[4];
    __m512 a[4];
    for (int j = 0; j < 4; j++) {
      u[j] = _mm512_loadu_si512(w[j].u + c * kChunk);
      a[j] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(w[j].a + c * 4)));
    }
    for (int r = 0; r < 2; r++) {
      // The same integers and floats as `chunk` reads from nsum4 and lane, made from the codes and the per-16
      // scales here: 128 bytes fewer to stream per chunk and row, which bounded a prefill.
      const int64_t m = m0 + r;
      const __m512i q = _mm512_loadu_si512(&x.q[m * x.K64 + c * kChunk]);
      __m512i init = _mm512_setzero_si512();
      if constexpr (Shift >= 0) {
        const __m512i sum4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q);
        init = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum4, Shift));
      }
      const __m512 lane =
          _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(&x.scale16[m * x.S + c * 4])));
      for (int j = 0; j < 4; j++) acc[r][j] = step(acc[r][j], init, u[j], q, a[j], lane);
    }
  }
  for (int r = 0; r < 2; r++)
    for (int j = 0; j < 4; j++) finish<1, Shift>(&acc[r][j], w[j].b, x, m0 + r, y + r * ldy + j, ldy);
}

// Every activation row against `rows` unpacked weight rows (a tile): 4 x 2 register blocks, the rest one by one.
template <int Shift>
void dot_tile(const RowView* w, int64_t rows, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) dot_4x2<Shift>(w + r, x, m, y + m * ldy + r, ldy);
    for (; m < M; m++)
      for (int j = 0; j < 4; j++) dot_rows<1, Shift>(w[r + j], x, m, y + m * ldy + r + j, ldy);
  }
  for (; r < rows; r++) dot_all<Shift>(w[r], x, M, y + r, ldy);
}

inline void dot_tile(int64_t type, const RowView* w, int64_t rows, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  switch (zero_shift(type)) {
    case 3: return dot_tile<3>(w, rows, x, M, y, ldy);
    case 4: return dot_tile<4>(w, rows, x, M, y, ldy);
    case 5: return dot_tile<5>(w, rows, x, M, y, ldy);
    case 7: return dot_tile<7>(w, rows, x, M, y, ldy);
    default: return dot_tile<-1>(w, rows, x, M, y, ldy);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)

// No VNNI: gguf_decode_avx2.h, 32 columns a step; the tiles run the sequence of its decode rows.
template <int64_t Type>
void dot_tile(const RowView* w, int64_t rows, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; r++) {
    int64_t m = 0;
    for (; m + kRowBlock <= M; m += kRowBlock) tile_rows<Type, kRowBlock>(w[r].u, w[r].a, w[r].b, x, m, y + m * ldy + r, ldy);
    for (; m < M; m++) tile_rows<Type, 1>(w[r].u, w[r].a, w[r].b, x, m, y + m * ldy + r, ldy);
  }
}

inline void dot_tile(int64_t type, const RowView* w, int64_t rows, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  switch (type) {
    case kQ4_0: return dot_tile<kQ4_0>(w, rows, x, M, y, ldy);
    case kQ5_0: return dot_tile<kQ5_0>(w, rows, x, M, y, ldy);
    case kQ8_0: return dot_tile<kQ8_0>(w, rows, x, M, y, ldy);
    case kQ4_K: return dot_tile<kQ4_K>(w, rows, x, M, y, ldy);
    default: return dot_tile<kQ6_K>(w, rows, x, M, y, ldy);
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
// registers, activation rows kRowBlock at a time over the same weights (which the earlier block left in L1/L2), NR
// = side_by_side weight rows side by side: 4, or 2 where the activation rows' accumulators would fill the registers
// (AVX2 has 16; on AVX-512, Q4_K's offsets double them). Measured (benchmarks.gguf_linear, one thread, all layers;
// RESULTS.md, issue 38 session 16): on VNNI the decode path beats the tiles up to 16 rows (at 9-16: gate_up 9-17%
// faster) and 4 rows side by side beat 2 at 3-8 activation rows (gate_up 7-16%, down 12-29%); on AVX2 the decode
// path at 9-16 rows was slower than its tiles. Each pair runs the same sequence either way: the same bits.
#if defined(RADIXSERVE_GGUF_VNNI)
constexpr int64_t kFusedRows = 16;
template <int64_t Type, int RB>
constexpr int side_by_side() { return RB <= 2 || Type != kQ4_K ? 4 : 2; }
#else
constexpr int64_t kFusedRows = 8;
template <int64_t, int RB>
constexpr int side_by_side() { return RB <= 2 ? 4 : 2; }
#endif
inline bool fused(int64_t, int64_t M, int64_t K) { return M <= kFusedRows && K % kChunk == 0; }

template <int64_t Type, int RB>
void fused_rows(const uint8_t* row, int64_t row_bytes, int64_t rows, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  constexpr int NR = side_by_side<Type, RB>();
  int64_t r = 0;
  for (; r + NR <= rows; r += NR) decode_rows<Type, NR, RB>(row + r * row_bytes, row_bytes, x, m0, y + r, ldy);
  for (; r < rows; r++) decode_rows<Type, 1, RB>(row + r * row_bytes, row_bytes, x, m0, y + r, ldy);
}

template <int64_t Type>
void fused_rows(const uint8_t* row, int64_t row_bytes, int64_t rows, const QuantX& x, int64_t M, float* y, int64_t ldy) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    float* ym = y + m0 * ldy;
    switch (std::min(M - m0, kRowBlock)) {
      case 1: fused_rows<Type, 1>(row, row_bytes, rows, x, m0, ym, ldy); break;
      case 2: fused_rows<Type, 2>(row, row_bytes, rows, x, m0, ym, ldy); break;
      case 3: fused_rows<Type, 3>(row, row_bytes, rows, x, m0, ym, ldy); break;
      default: fused_rows<Type, 4>(row, row_bytes, rows, x, m0, ym, ldy);
    }
  }
}

// `rows` weight rows from `row` against all M (<= kFusedRows) activation rows.
inline void fused_rows(int64_t type, const uint8_t* row, int64_t row_bytes, int64_t rows, const QuantX& x, int64_t M,
                       float* y, int64_t ldy) {
  switch (type) {
    case kQ4_0: return fused_rows<kQ4_0>(row, row_bytes, rows, x, M, y, ldy);
    case kQ5_0: return fused_rows<kQ5_0>(row, row_bytes, rows, x, M, y, ldy);
    case kQ8_0: return fused_rows<kQ8_0>(row, row_bytes, rows, x, M, y, ldy);
    case kQ4_K: return fused_rows<kQ4_K>(row, row_bytes, rows, x, M, y, ldy);
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

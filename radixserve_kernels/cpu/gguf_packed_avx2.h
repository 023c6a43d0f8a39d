// A prefill's linears on AVX2 (no VNNI), for the formats whose decode rows take the codes with the lanes as weight
// rows (Q4_0 and Q5_0: lanes_chunk, gguf_decode_avx2.h; the K-quants: kquant_lanes8, gguf_kquants_avx2.h). Past a
// decode step's rows, each group of eight weight rows is transposed once, straight from the blocks, into what those
// forms read, and every block of activation rows then reads it from L1/L2. Taken by the decode rows (or, for Q4_0 and
// Q5_0, an unpacked tile), the transposes and the gathers of the scales were redone for each block of activation
// rows: at 128 rows, a quarter of Q4_0's and Q5_0's time and 11-21% of the K-quants' (RESULTS.md, issue 38 session
// 41). Each pair of activation and weight row runs the same integers and float steps as the decode rows, so the same
// bits.
#pragma once

#include "gguf_activations.h"
#include "gguf_blocks.h"
#include "gguf_decode_avx2.h"
#include "gguf_kquants_avx2.h"

#include <algorithm>
#include <vector>

namespace radixserve::gguf {

// Whether this build packs `type`'s weight rows for a prefill (AVX2 builds: Q4_0, Q5_0 and the K-quants).
constexpr bool packs_rows(int64_t type) {
  return kRound256 && (type == kQ4_0 || type == kQ5_0 || type == kQ4_K || type == kQ5_K || type == kQ6_K);
}

}  // namespace radixserve::gguf

#if defined(__AVX2__) && defined(__FMA__) && !defined(RADIXSERVE_GGUF_VNNI)

namespace radixserve::gguf {

constexpr int kPackedRowBlock = 4;  // Q4_0 and Q5_0: activation rows a pass over the packed rows (6 and 8: slower)

// Q4_0 and Q5_0: one chunk of eight weight rows, packed.
struct LanesChunk {
  __m256i t[2][4];  // per half: lanes16's registers (lanes_chunk's t)
  __m256 a;         // the eight rows' scales, lane j row j
};

template <int64_t Type>
void pack_lanes(const uint8_t* row, int64_t row_bytes, int nr, std::vector<LanesChunk>& chunks) {
  constexpr int64_t kBytes = format_bytes(Type), span = kRowGroup * kBytes;
  const uint8_t* rows[kRowGroup];
  group_rows(row, row_bytes, nr, rows);
  const uint8_t* ahead = row + kPrefetchAhead;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); c++) {
    ahead = prefetch_span(ahead, span);
    __m256i(&lo)[4] = chunks[c].t[0];
    __m256i(&hi)[4] = chunks[c].t[1];
    chunk_pairs<Type>(rows, c, lo, hi);
    transpose4(lo[0], lo[1], lo[2], lo[3]);
    transpose4(hi[0], hi[1], hi[2], hi[3]);
    chunks[c].a = d8(rows, c * kBytes);
  }
}

template <int64_t Type, int RB>
inline void lanes_tile_rows(const std::vector<LanesChunk>& chunks, int nr, const QuantX& x, int64_t m0, float* y,
                            int64_t ldy) {
  XRow xr[RB];
  x_rows(x, m0, xr);
  __m256 acc[RB];
  for (int r = 0; r < RB; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); c++) {
    const auto lanes = [&](int h, __m256i (&t)[4]) {
      for (int k = 0; k < 4; k++) t[k] = chunks[c].t[h][k];
    };
    lanes_sums<Type, RB>(acc, lanes, chunks[c].a, xr, c);
  }
  store_rows<RB>(acc, nr, y, ldy);
}

// Q4_0, Q5_0: `rows` weight rows from `row` against all M activation rows, eight weight rows packed at a time.
template <int64_t Type>
void lanes_tile(const uint8_t* row, int64_t row_bytes, int64_t rows, const QuantX& x, int64_t M, float* y,
                int64_t ldy) {
  thread_local std::vector<LanesChunk> chunks;
  chunks.resize(x.K64 / kChunk32);
  for (int64_t r = 0; r < rows; r += kRowGroup) {
    const int nr = static_cast<int>(std::min<int64_t>(kRowGroup, rows - r));
    pack_lanes<Type>(row + r * row_bytes, row_bytes, nr, chunks);
    int64_t m = 0;
    for (; m + kPackedRowBlock <= M; m += kPackedRowBlock)
      lanes_tile_rows<Type, kPackedRowBlock>(chunks, nr, x, m, y + m * ldy + r, ldy);
    for (; m < M; m++) lanes_tile_rows<Type, 1>(chunks, nr, x, m, y + m * ldy + r, ldy);
  }
}

// The K-quants: RB activation rows from m0 against eight weight rows' super-blocks, filled before (lanes8_step).
template <int64_t Type, int RB>
inline void kquant_tile_rows(const std::vector<Lanes8<Type>>& sbs, int nr, const QuantX& x, int64_t m0, float* y,
                             int64_t ldy) {
  const int8_t* xq[RB];
  const int16_t* sums[RB];
  lanes8_rows(x, m0, xq, sums);
  __m256 acc[RB], off[RB];
  for (int r = 0; r < RB; r++) acc[r] = off[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < static_cast<int64_t>(sbs.size()); s++) lanes8_step<Type, RB>(sbs[s], xq, sums, x, m0, s, acc, off);
  for (int r = 0; r < RB; r++) acc[r] = _mm256_sub_ps(acc[r], off[r]);
  store_rows<RB>(acc, nr, y, ldy);
}

// Q4_K, Q5_K, Q6_K: `rows` weight rows from `row` against all M activation rows, eight weight rows' super-blocks
// filled at a time (19 of them, ~50 KB, for a 4864-column row), then kRowGroup activation rows a pass.
template <int64_t Type>
void kquant_tile(const uint8_t* row, int64_t row_bytes, int64_t rows, const QuantX& x, int64_t M, float* y,
                 int64_t ldy) {
  using L = Lanes8<Type>;
  constexpr int64_t span = kRowGroup * L::kBytes;
  thread_local std::vector<L> sbs;
  sbs.resize(x.K64 / 256);
  for (int64_t r = 0; r < rows; r += kRowGroup) {
    const int nr = static_cast<int>(std::min<int64_t>(kRowGroup, rows - r));
    const uint8_t* at[kRowGroup];
    group_rows(row + r * row_bytes, row_bytes, nr, at);
    const uint8_t* ahead = row + r * row_bytes + kKquantAhead;
    for (int64_t s = 0; s < static_cast<int64_t>(sbs.size()); s++) {
      ahead = prefetch_span(ahead, span);
      fill_super_block(sbs[s], at, s, scale_index());
    }
    for (int64_t m = 0; m < M; m += kRowGroup) {
      float* ym = y + m * ldy + r;
      const auto pass = [&](auto rb) { kquant_tile_rows<Type, rb.value>(sbs, nr, x, m, ym, ldy); };
      with_count(std::min<int64_t>(M - m, kRowGroup), pass);
    }
  }
}

// `rows` weight rows from `row` against all M activation rows (more than a decode step's), packed eight at a time.
template <int64_t Type>
void packed_rows(const uint8_t* row, int64_t row_bytes, int64_t rows, const QuantX& x, int64_t M, float* y,
                 int64_t ldy) {
  static_assert(packs_rows(Type));
  if constexpr (nibble_chunks<Type>())
    lanes_tile<Type>(row, row_bytes, rows, x, M, y, ldy);
  else
    kquant_tile<Type>(row, row_bytes, rows, x, M, y, ldy);
}

}  // namespace radixserve::gguf

#endif

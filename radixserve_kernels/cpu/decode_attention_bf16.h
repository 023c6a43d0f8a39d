// decode_attention.cpp's path for bfloat16 queries over bfloat16 pages on CPUs with AVX512_BF16 (Zen 4, Intel from
// Cooper Lake): the scores by vdpbf16ps over keys transposed 16 at a time, the values' pass by vdpbf16ps over all
// the group's heads at once. Included by decode_attention.cpp inside its anonymous namespace, after its AVX-512 path
// (Rows, max_lanes, exp16), which float32 and int8 pages and float32 queries still take.
//
// Why: the AVX-512 path holds a key row's head_dim values in lanes, so each dot product ends in a horizontal sum
// (a shuffle tree over four heads), and it widens every key and value row once per block of four heads (twice for
// the default model's seven). Per key of seven 64-wide heads that was ~120 vector operations for 56 multiply-adds.
// Here the 16 keys of a tile go to the lanes (a 16 x 16 transpose of their bfloat16 pairs, simd::transpose16), so
// a score is a vdpbf16ps chain over head_dim / 2 pairs, one lane per key, with no horizontal sum. The values' pass
// is vdpbf16ps too, over two keys' rows interleaved and their two weights as the broadcast pair: half the
// float32 path's multiply-add instructions (1.2x faster again over a prefill's rows and over eight decode rows in
// cache, 1.07-1.14x over a decode step's pages in memory; benchmarks.attention_op, RESULTS.md issue 38 session 52).
//
// What it computes: the query as the model produced it (bfloat16, so each product of two bfloat16 values is exact in
// float32), each score as one float32 chain over the pairs in order (vdpbf16ps: the pair's two products added in
// turn, denormals read and written as zero), then times the scale; the softmax's numerators exp(s - max) in float32,
// rounded to bfloat16 (each weight within 2^-9 of itself, and the normalizer is the sum of the rounded ones, so the
// weights still sum to one), and the weighted sum of values as float32 chains of exact products. That rounding is
// below what the output meets next: its own rounding to bfloat16 (2^-9), then, with a GGUF's blocks or int8
// weights, the o projection's activations quantized to int8. A query row's result depends on its own keys only, as
// in every path here: a prefill's rows and a decode step's row get the same bits (the deterministic mode rests on it).
#pragma once

// Two bfloat16 values read as one word (the query's pairs, the softmax's weights of two keys).
typedef uint32_t __attribute__((may_alias, aligned(2))) Pair;

// The offsets from a Rows' buf of its rows (keys or values) in tiles of 16 (-1 past len), walking the pages as
// Rows::each does, no division per row.
struct TileWalk {
  const Rows<at::BFloat16>& rows;
  int64_t page = 0, slot = 0, t = 0;

  void next(int64_t* off) {
    for (int i = 0; i < 16; i++, t++) {
      if (t >= rows.len) {
        off[i] = -1;
        continue;
      }
      off[i] = (static_cast<int64_t>(rows.pages[page]) * rows.page_size + slot) * rows.stride;
      if (++slot == rows.page_size) slot = 0, page++;
    }
  }
};

// A tile's keys and values (rows at the offsets, -1: none) into L2. The hint is written out: passed in as a template
// argument, GCC 12 left the prefetcht1s out of the object altogether.
template <int kLines>
inline void to_l2(const int64_t* off, const at::BFloat16* keys, const at::BFloat16* values) {
  for (int i = 0; i < 16 && off[i] >= 0; i++)
    for (int l = 0; l < kLines; l++) {
      _mm_prefetch(reinterpret_cast<const char*>(keys + off[i]) + 64 * l, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(values + off[i]) + 64 * l, _MM_HINT_T1);
    }
}

// The keys of k in tiles of 16: f(t0, rows), rows[i] the key t0 + i, or a row of zeros past k.len (their scores are
// stored, never read). Prefetched (head_dim 16 C): the keys and values kAhead tiles ahead into L2 (the values are
// read by the pass after this one), the next tile's keys from there into L1. Measured over pages in memory (eight
// requests of 1,000 keys on shuffled pages, 24 layers: benchmarks.attention_op's `step`; RESULTS.md, issue 38
// session 51): without prefetch slower than the AVX-512 path, whose rows come one at a time; the next tile's keys
// into L1 and this tile's values into L2 about level with it; the L2 sweep 4 tiles ahead ~1.45x faster than that
// (3 ahead about the same, 2, 5 and 8 slower).
template <int C, typename F>
inline void each_tile(const Rows<at::BFloat16>& k, const at::BFloat16* v_buf, F&& f) {
  alignas(64) static const uint16_t zeros[128] = {};  // head_dim <= 128
  constexpr int kLines = C / 2, kAhead = 4;  // 64-byte lines of a row; tiles the L2 sweep runs ahead
  TileWalk walk{k};
  int64_t off[kAhead + 1][16];  // a ring: the tile at t0 = 16 j is off[j % (kAhead + 1)]
  for (int a = 0; a < kAhead; a++) {
    walk.next(off[a]);
    if (a > 0) to_l2<kLines>(off[a], k.buf, v_buf);
  }
  const void* rows[16];
  for (int64_t t0 = 0, j = 0; t0 < k.len; t0 += 16, j++) {
    walk.next(off[(j + kAhead) % (kAhead + 1)]);
    to_l2<kLines>(off[(j + kAhead) % (kAhead + 1)], k.buf, v_buf);
    const int64_t* next = off[(j + 1) % (kAhead + 1)];
    for (int i = 0; i < 16 && next[i] >= 0; i++)
      for (int l = 0; l < kLines; l++)
        _mm_prefetch(reinterpret_cast<const char*>(k.buf + next[i]) + 64 * l, _MM_HINT_T0);
    const int64_t* cur = off[j % (kAhead + 1)];
    for (int i = 0; i < 16; i++) rows[i] = cur[i] >= 0 ? static_cast<const void*>(k.buf + cur[i]) : zeros;
    f(t0, rows);
  }
}

// acc + the dot products of w's bfloat16 pairs with the pair at p, broadcast: one vdpbf16ps with p as its {1to16}
// memory operand (from _mm512_set1_epi32 GCC makes a vpbroadcastd of its own per head and pair).
inline __m512 dpbf16_broadcast(__m512 acc, __m512bh w, const uint32_t* p) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*p));
  return acc;
}

// s[h * ls + t] = scale * (q[h] . key t) for NG heads, q[h] the head's D / 2 bfloat16 pairs (D = 16 C).
template <int C, int NG>
void scores_bf16(const uint32_t* const* q, float scale, const Rows<at::BFloat16>& k, const at::BFloat16* v_buf,
                 float* s, int64_t ls) {
  constexpr int kPairs = 8 * C;
  alignas(64) uint32_t kt[kPairs * 16];  // pair j of the tile's 16 keys at kt[16 j ..]
  each_tile<C>(k, v_buf, [&](int64_t t0, const void* const* rows) {
    for (int b = 0; b < kPairs / 16; b++) radixserve::simd::transpose16(rows, 64 * b, kt + 256 * b);
    __m512 acc[NG];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int j = 0; j < kPairs; j++) {
      const __m512bh kj = reinterpret_cast<__m512bh>(_mm512_load_si512(kt + 16 * j));
      for (int h = 0; h < NG; h++)
        acc[h] = dpbf16_broadcast(acc[h], kj, q[h] + j);
    }
    for (int h = 0; h < NG; h++) _mm512_storeu_ps(s + h * ls + t0, _mm512_mul_ps(acc[h], _mm512_set1_ps(scale)));
  });
}

// The softmax's numerators as bfloat16, in place: p[t] = exp(s[t] - max) over t < L, rounded to bfloat16 and
// stored as the bfloat16 words from s's start (word t at byte 2 t, behind the float read at byte 4 t), zeros after
// it up to a multiple of 32; returns 1 / the sum of the rounded p, so the weights the values get sum to one.
inline float probs_bf16(float* s, int64_t L) {
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(max_lanes(s, L)));
  auto* p = reinterpret_cast<__m512i*>(s);
  __m512 z = _mm512_setzero_ps();
  for (int64_t i = 0; i < L; i += 32, p++) {
    __m512 e[2];
    for (int j = 0; j < 2; j++) {
      const int64_t n = std::clamp<int64_t>(L - i - 16 * j, 0, 16);
      const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
      e[j] = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + i + 16 * j), m)));
    }
    const __m512i b = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e[1], e[0]));  // e[0] in the low 16 words
    _mm512_storeu_si512(p, b);
    z = _mm512_add_ps(z, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));                        // even t
    z = _mm512_add_ps(z, _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(-65536))));  // odd t
  }
  return 1.f / _mm512_reduce_add_ps(z);
}

// out[h] = inv[h] * sum_t p[h][t] * value t, for NG heads, p[h] the bfloat16 words of probs_bf16 at s + h * ls: a
// pass over the values per 32 of the row's values, two keys at a time. Their two rows' words are interleaved
// (vpunpck{l,h}wd: lane 4 l + i of lo holds the pair of value 8 l + i, of hi value 8 l + 4 + i, l the 128-bit lane)
// and each head's lane adds p[t] v[t] + p[t + 1] v[t + 1] by one vdpbf16ps, with the two weights as its broadcast
// pair; the lanes go back to the values' order once, at the end.
template <int C, int NG>
void values_bf16(const float* s, int64_t ls, const float* inv, const Rows<at::BFloat16>& v, float* out) {
  const __m512i lo_order = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_order = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c0 = 0; c0 < C; c0 += 2) {
    __m512 acc[NG][2];
    for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
    TileWalk walk{v};
    int64_t off[16];
    for (int64_t t0 = 0; t0 < v.len; t0 += 16) {
      walk.next(off);
      for (int i = 0; i < 16 && off[i] >= 0; i += 2) {
        const __m512i a = _mm512_loadu_si512(v.buf + off[i] + 16 * c0);
        const __m512i b =
            off[i + 1] >= 0 ? _mm512_loadu_si512(v.buf + off[i + 1] + 16 * c0) : _mm512_setzero_si512();
        const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
        const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
        for (int h = 0; h < NG; h++) {
          const Pair* pair = reinterpret_cast<const Pair*>(s + h * ls) + (t0 + i) / 2;
          acc[h][0] = dpbf16_broadcast(acc[h][0], lo, pair);
          acc[h][1] = dpbf16_broadcast(acc[h][1], hi, pair);
        }
      }
    }
    for (int h = 0; h < NG; h++) {
      const __m512 scale = _mm512_set1_ps(inv[h]);
      float* o = out + h * 16 * C + 16 * c0;
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_permutex2var_ps(acc[h][0], lo_order, acc[h][1]), scale));
      _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_permutex2var_ps(acc[h][0], hi_order, acc[h][1]), scale));
    }
  }
}

template <int C, int NG>
void attend_block_bf16(const at::BFloat16* q, int64_t q_head, float scale, const Rows<at::BFloat16>& k,
                       const Rows<at::BFloat16>& v, float* s, int64_t ls, float* out) {
  const uint32_t* qh[NG];
  for (int h = 0; h < NG; h++) qh[h] = reinterpret_cast<const Pair*>(q + h * q_head);
  scores_bf16<C, NG>(qh, scale, k, v.buf, s, ls);
  float inv[NG];
  for (int h = 0; h < NG; h++) inv[h] = probs_bf16(s + h * ls, k.len);
  values_bf16<C, NG>(s, ls, inv, v, out);
}

// attend's arguments for bfloat16 queries (q: g heads, q_head apart; not pre-scaled) and pages, head_dim 16 C: the
// heads in blocks of at most 8, as even as possible; s holds g rows of ls >= k.len rounded up to 16 floats. The split
// is head_blocks' (decode_attention.cpp), written out: through head_blocks' lambdas GCC 12 stopped inlining the
// values' pass, and the op took 2.5-6% longer over a prefill's rows (benchmarks.attention_op, alternated).
template <int C>
void attend_heads_bf16(const at::BFloat16* q, int64_t q_head, int64_t g, float scale, const Rows<at::BFloat16>& k,
                       const Rows<at::BFloat16>& v, float* s, int64_t ls, float* out) {
  const int64_t blocks = (g + 7) / 8, per = (g + blocks - 1) / blocks;
  for (int64_t h0 = 0; h0 < g; h0 += per) {
    const at::BFloat16* qb = q + h0 * q_head;
    float* ob = out + h0 * 16 * C;
    switch (std::min(per, g - h0)) {
      case 1: attend_block_bf16<C, 1>(qb, q_head, scale, k, v, s, ls, ob); break;
      case 2: attend_block_bf16<C, 2>(qb, q_head, scale, k, v, s, ls, ob); break;
      case 3: attend_block_bf16<C, 3>(qb, q_head, scale, k, v, s, ls, ob); break;
      case 4: attend_block_bf16<C, 4>(qb, q_head, scale, k, v, s, ls, ob); break;
      case 5: attend_block_bf16<C, 5>(qb, q_head, scale, k, v, s, ls, ob); break;
      case 6: attend_block_bf16<C, 6>(qb, q_head, scale, k, v, s, ls, ob); break;
      case 7: attend_block_bf16<C, 7>(qb, q_head, scale, k, v, s, ls, ob); break;
      default: attend_block_bf16<C, 8>(qb, q_head, scale, k, v, s, ls, ob); break;
    }
  }
}

inline void attend_bf16(const at::BFloat16* q, int64_t q_head, int64_t g, int64_t D, float scale,
                        const Rows<at::BFloat16>& k, const Rows<at::BFloat16>& v, float* s, int64_t ls, float* out) {
  if (D == 64) return attend_heads_bf16<4>(q, q_head, g, scale, k, v, s, ls, out);
  return attend_heads_bf16<8>(q, q_head, g, scale, k, v, s, ls, out);
}

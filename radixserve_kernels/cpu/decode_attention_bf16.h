// decode_attention.cpp's path for bfloat16 queries over bfloat16 pages on CPUs with AVX512_BF16 (Zen 4, Intel from
// Cooper Lake): the scores by vdpbf16ps over keys transposed 16 at a time, the values' pass over all the group's
// heads at once. Included by decode_attention.cpp inside its anonymous namespace, after its AVX-512 path (Rows,
// load16, exp16), which float32 and int8 pages and float32 queries still take.
//
// Why: the AVX-512 path holds a key row's head_dim values in lanes, so each dot product ends in a horizontal sum
// (a shuffle tree over four heads), and it widens every key and value row once per block of four heads (twice for
// the default model's seven). Per key of seven 64-wide heads that was ~120 vector operations for 56 multiply-adds.
// Here the 16 keys of a tile go to the lanes (a 16 x 16 transpose of their bfloat16 pairs, simd::transpose16), so
// a score is a vdpbf16ps chain over head_dim / 2 pairs, one lane per key, with no horizontal sum; the values are
// widened once, and each pass over them takes two of the row's 16-lane registers for all the heads.
//
// What it computes: the query as the model produced it (bfloat16, so each product of two bfloat16 values is exact in
// float32), each score as one float32 chain over the pairs in order (vdpbf16ps: the pair's two products added in
// turn, denormals read and written as zero), then times the scale; the softmax and the weighted sum of values in
// float32 as the other paths do. A query row's result depends on its own keys only, as in every path here: a
// prefill's rows and a decode step's row get the same bits (the deterministic mode rests on it).
#pragma once

// The offsets from a Rows' buf of its keys in tiles of 16 (-1 past len), walking the pages as Rows::each does, no
// division per key.
struct TileWalk {
  const Rows<at::BFloat16>& k;
  int64_t page = 0, slot = 0, t = 0;

  void next(int64_t* off) {
    for (int i = 0; i < 16; i++, t++) {
      if (t >= k.len) {
        off[i] = -1;
        continue;
      }
      off[i] = (static_cast<int64_t>(k.pages[page]) * k.page_size + slot) * k.stride;
      if (++slot == k.page_size) slot = 0, page++;
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

// In place exp(s[t] - max) over t < L; returns 1 / their sum.
inline float exp_row(float* s, int64_t L) {
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(max_lanes(s, L)));
  return 1.f / _mm512_reduce_add_ps(exp_lanes(s, L, m));
}

// out[h] = inv[h] * sum_t s[h * ls + t] * value t, for NG heads: a pass over the values per two registers of the
// row (2 NG accumulators), each value register widened once for all the heads.
template <int C, int NG>
void values_bf16(const float* s, int64_t ls, const float* inv, const Rows<at::BFloat16>& v, float* out) {
  for (int c0 = 0; c0 < C; c0 += 2) {
    __m512 acc[NG][2];
    for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
    v.each([&](int64_t t, const at::BFloat16* vr) {
      const __m512 v0 = load16(vr + 16 * c0), v1 = load16(vr + 16 * c0 + 16);
      for (int h = 0; h < NG; h++) {
        const __m512 p = _mm512_set1_ps(s[h * ls + t]);
        acc[h][0] = _mm512_fmadd_ps(p, v0, acc[h][0]);
        acc[h][1] = _mm512_fmadd_ps(p, v1, acc[h][1]);
      }
    });
    for (int h = 0; h < NG; h++)
      for (int i = 0; i < 2; i++)
        _mm512_storeu_ps(out + h * 16 * C + 16 * (c0 + i), _mm512_mul_ps(acc[h][i], _mm512_set1_ps(inv[h])));
  }
}

template <int C, int NG>
void attend_block_bf16(const at::BFloat16* q, int64_t q_head, float scale, const Rows<at::BFloat16>& k,
                       const Rows<at::BFloat16>& v, float* s, int64_t ls, float* out) {
  typedef uint32_t __attribute__((may_alias, aligned(2))) Pair;  // two bfloat16 values read as one word
  const uint32_t* qh[NG];
  for (int h = 0; h < NG; h++) qh[h] = reinterpret_cast<const Pair*>(q + h * q_head);
  scores_bf16<C, NG>(qh, scale, k, v.buf, s, ls);
  float inv[NG];
  for (int h = 0; h < NG; h++) inv[h] = exp_row(s + h * ls, k.len);
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

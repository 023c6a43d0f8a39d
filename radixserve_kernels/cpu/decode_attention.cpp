// Paged decode attention: one query token per request, keys and values read in place from the KV pool's pages.
//
// out[r, h] = softmax_t(q[r, h] . K[r, t, h / ratio] * scale) . V[r, t, h / ratio] over t < seq_lens[r], where
// key t of request r sits in pool page page_table[r, t / page_size], row t % page_size. The pool's per-layer
// buffers are [num_pages, page_size, kv_heads, row] (radixserve/cache/kv_pool.py): bfloat16 or float32 rows of
// head_dim, or int8 rows of head_dim values then a float16 scale per group of them (radixserve/cache/kv_format.py;
// keys and values have their own groups, each a multiple of 16 read off its buffer's row width: 72- and 66-byte
// rows at head_dim 64), read as value * its group's scale (one multiply per 16-lane register, as it is widened);
// q is [num_reqs, heads, head_dim] (bfloat16 or float32, rows may be strided), the output has q's dtype. int8 keys
// and values are stored rotated (kv_rotate.h): over int8 pages the op rotates the query the same way itself, and its
// float32 output (a sum of rotated values) back, S H, before the one rounding to q's dtype, so the caller passes q as the
// model computed it and gets the output in the model's space.
//
// Why: the pure-torch path gathers every request's pages into a contiguous copy (index_select) and then calls SDPA,
// once per layer; on a CPU decode step that copy plus the per-op overheads cost more than the arithmetic. Here
// each (request, kv head) is one work item for the spin pool (below). In the float32 paths the query heads sharing
// the kv head (GQA) are processed in blocks of up to 4, so every key/value row is loaded and widened to float32 once
// per block. Two passes, all in float32: the block's scores (q is pre-scaled), stored 4 heads side by side so one
// shuffle tree reduces 4 dot products (a horizontal sum per dot product took ~40% longer at 1,000 keys), then max,
// exp and sum per head, then the weighted sum of values. The scores buffer is max(4, heads per kv head) floats per
// key, the keys rounded up to whole tiles of 16 (the bfloat16 path keeps each head's scores in a row of its own).
//
// Paths, chosen at compile time (-march=native): AVX-512 for head_dim 64 or 128 (one row = 4 or 8 registers), and
// with AVX512_BF16 its own path for bfloat16 queries over bfloat16 pages (decode_attention_bf16.h, vdpbf16ps for
// the scores and the values, the softmax's weights rounded to bfloat16: 1.5x faster than the AVX-512 path over a
// prefill's 256 rows at 1,200 keys, 1.4x over eight decode rows of 1,000; benchmarks.attention_op); AVX2 with FMA
// for the same head_dims (decode_attention_avx2.h); plain C++ otherwise (any head_dim, or an older CPU).
#include "ops.h"
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_rotate.h"
#include "spin_pool.h"
#include "with_count.h"
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include "transpose16.h"
#endif

namespace {

// Where the keys (or values) of one request and one kv head lie in a pool buffer.
template <typename T>
struct Rows {
  // The layer's buffer, offset to the kv head: row (page, slot) at buf + (page * ps + slot) * stride.
  const T* buf;
  const int32_t* pages;  // the request's page-table row
  int64_t page_size, stride, len;
  int64_t group;  // values per scale of an int8 row (unused for float rows)

  // f(t, row) for t = 0 .. len - 1, page by page (no division per key).
  template <typename F>
  inline void each(F&& f) const {
    for (int64_t t0 = 0; t0 < len; t0 += page_size) {
      const T* row = buf + static_cast<int64_t>(pages[t0 / page_size]) * page_size * stride;
      const int64_t n = std::min(page_size, len - t0);
      for (int64_t i = 0; i < n; i++, row += stride) f(t0 + i, row);
    }
  }
};

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }
inline float widen(int8_t x) { return static_cast<float>(x); }

// The factor elements d of a stored row are multiplied by: 1 for float rows; for int8, the float16 scale of the
// group of G holding d, stored after the D values.
template <typename T>
inline float row_scale(const T*, int64_t, int64_t, int64_t) {
  return 1.f;
}
inline float row_scale(const int8_t* row, int64_t D, int64_t G, int64_t d) {
  uint16_t bits;
  std::memcpy(&bits, row + D + 2 * (d / G), sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable conversion is ~10 per key
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// a . b over D values as 8 running sums (lane d % 8, then a tree): a fixed order the compiler turns into one vector
// register where the CPU has them (AVX2: the path every CPU without AVX-512 takes); a sum in d order cannot be
// vectorized without reordering it, and ran 2x slower at 1,000 keys (14 x 64 heads, float32 pages, warm).
inline float dot8(const float* a, const float* b, int64_t D) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int l = 0; l < 8; l++) acc[l] += a[d + l] * b[d + l];
  for (; d < D; d++) acc[d % 8] += a[d] * b[d];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Plain C++: any head_dim. q [g, D] pre-scaled, s scratch [g, len], out [g, D] float32.
template <typename T>
void attend_plain(const float* q, int64_t g, int64_t D, const Rows<T>& k, const Rows<T>& v, float* s, float* out) {
  const int64_t L = k.len;
  std::vector<float> row(D);
  k.each([&](int64_t t, const T* kr) {
    for (int64_t d = 0; d < D; d++) row[d] = widen(kr[d]) * row_scale(kr, D, k.group, d);
    for (int64_t h = 0; h < g; h++) s[h * L + t] = dot8(q + h * D, row.data(), D);
  });
  std::vector<float> sum(g);
  for (int64_t h = 0; h < g; h++) {
    float* sh = s + h * L;
    const float m = *std::max_element(sh, sh + L);
    float z = 0;
    for (int64_t t = 0; t < L; t++) z += (sh[t] = std::exp(sh[t] - m));
    sum[h] = z;
  }
  std::fill(out, out + g * D, 0.f);
  v.each([&](int64_t t, const T* vr) {
    for (int64_t d = 0; d < D; d++) row[d] = widen(vr[d]) * row_scale(vr, D, v.group, d);
    for (int64_t h = 0; h < g; h++)
      for (int64_t d = 0; d < D; d++) out[h * D + d] += s[h * L + t] * row[d];
  });
  for (int64_t h = 0; h < g; h++)
    for (int64_t d = 0; d < D; d++) out[h * D + d] /= sum[h];
}

// The softmax's exp in both vector paths: x = n ln2 + r with ln2 in two parts (n * kLn2Hi is exact), then e^r by
// its degree-6 Taylor polynomial, coefficients from the highest power down (Horner).
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
constexpr float kExpTaylor[7] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

// f(n, h0) over g query heads in blocks of at most kMax (<= 8), as even as possible: the block of n heads from h0,
// n a std::integral_constant (the vector paths' block kernels take their head count as a template argument).
template <int kMax, typename F>
inline void head_blocks(int64_t g, const F& f) {
  const int64_t blocks = (g + kMax - 1) / kMax, per = (g + blocks - 1) / blocks;
  for (int64_t h0 = 0; h0 < g; h0 += per)
    radixserve::with_count(std::min(per, g - h0), [&](auto n) {
      if constexpr (decltype(n)::value <= kMax) f(n, h0);
    });
}

#if defined(__AVX512F__)
#include "decode_attention_avx512.h"

#if defined(__AVX512BF16__)
#define RADIXSERVE_ATTENTION_BF16 1
#include "decode_attention_bf16.h"
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#include "decode_attention_avx2.h"
#endif

template <typename T>
void attend(const float* q, int64_t g, int64_t D, const Rows<T>& k, const Rows<T>& v, float* s, float* out) {
#if defined(__AVX512F__)
  if (D == 64) return attend_heads<4>(q, g, k, v, s, out);
  if (D == 128) return attend_heads<8>(q, g, k, v, s, out);
#elif defined(__AVX2__) && defined(__FMA__)
  if (D == 64) return attend_heads<8>(q, g, k, v, s, out);
  if (D == 128) return attend_heads<16>(q, g, k, v, s, out);
#endif
  attend_plain(q, g, D, k, v, s, out);
}

// Whether decode_attention_bf16.h serves these queries and pages (q is then read as stored, not widened and scaled).
template <typename Q, typename T>
constexpr bool bf16_pairs(int64_t D) {
#if defined(RADIXSERVE_ATTENTION_BF16)
  return std::is_same_v<Q, at::BFloat16> && std::is_same_v<T, at::BFloat16> && (D == 64 || D == 128);
#else
  static_cast<void>(D);
  return false;
#endif
}

// attend_bf16 where bf16_pairs holds; called only then.
template <typename Q, typename T>
void attend_pairs(const Q* q, int64_t q_head, int64_t g, int64_t D, float scale, const Rows<T>& k, const Rows<T>& v,
                  float* s, int64_t ls, float* out) {
#if defined(RADIXSERVE_ATTENTION_BF16)
  if constexpr (std::is_same_v<Q, at::BFloat16> && std::is_same_v<T, at::BFloat16>)
    attend_bf16(q, q_head, g, D, scale, k, v, s, ls, out);
#endif
}

// Below this many multiply-adds (all requests, both passes) a step runs on the calling thread, above it the work
// items go to the decode kernels' spin pool (spin_pool.h), whose workers still spin from the layer's q/k/v linear
// just before, where OpenMP's sleeping threads (OMP_WAIT_POLICY=PASSIVE) took ~50 us to wake. Measured
// (benchmarks.decode_parts, the default model, alternated; RESULTS.md, issue 38 session 23): at 500 keys attention
// 1.54-1.75 -> 0.83-0.88 ms a step, at 2,000 keys 3.9-5.8 -> 2.6-2.9 ms (against OpenMP above 2^21); at 30 keys the
// same. 2^18 is ~150 keys of 14 x 64 heads. (Software prefetch of the scattered pages ahead measured no gain.)
constexpr int64_t kPoolWork = 1 << 18;

template <typename Q, typename T>
void run(const at::Tensor& q, const at::Tensor& kb, const at::Tensor& vb, const at::Tensor& table,
         const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KV = kb.size(2), ps = kb.size(1), G = H / KV;
  // The stored rows: D, or for int8 D values and their scales; K and V rows differ in width (and group) there.
  const int64_t KW = kb.size(3), VW = vb.size(3);
  const int64_t KG = std::is_same_v<T, int8_t> ? radixserve_kv::scale_group(D, KW) : D;  // values per scale
  const int64_t VG = std::is_same_v<T, int8_t> ? radixserve_kv::scale_group(D, VW) : D;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), P = table.size(1);
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const T *kp = kb.data_ptr<T>(), *vp = vb.data_ptr<T>();
  const int32_t *tp = table.data_ptr<int32_t>(), *lp = lens.data_ptr<int32_t>();
  int64_t work = 0, max_len = 0;
  for (int64_t r = 0; r < R; r++) {
    work += 2 * static_cast<int64_t>(lp[r]) * H * D;
    max_len = std::max<int64_t>(max_len, lp[r]);
  }
  const float sc = static_cast<float>(scale);
  const bool pairs = bf16_pairs<Q, T>(D);
  const int64_t ls = (std::max<int64_t>(max_len, 1) + 15) / 16 * 16;  // a head's scores, padded to whole tiles
  const std::function<void(int64_t, int64_t)> items = [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(pairs ? 0 : G * D), of(G * D), s(std::max<int64_t>(G, 4) * ls);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t r = i / KV, kvh = i % KV, h0 = kvh * G, L = lp[r];
      if (!pairs)  // (the bfloat16 path reads q where it lies)
        for (int64_t h = 0; h < G; h++)
          for (int64_t d = 0; d < D; d++) qf[h * D + d] = widen(qp[r * qs0 + (h0 + h) * qs1 + d]) * sc;
      if constexpr (std::is_same_v<T, int8_t>)
        for (int64_t h = 0; h < G; h++) radixserve_kv::fwht(qf.data() + h * D, D);
      if (L > 0) {
        const Rows<T> k{kp + kvh * KW, tp + r * P, ps, KV * KW, L, KG};
        const Rows<T> v{vp + kvh * VW, tp + r * P, ps, KV * VW, L, VG};
        if (pairs)
          attend_pairs(qp + r * qs0 + h0 * qs1, qs1, G, D, sc, k, v, s.data(), ls, of.data());
        else
          attend(qf.data(), G, D, k, v, s.data(), of.data());
      } else {
        std::fill(of.begin(), of.end(), 0.f);
      }
      if constexpr (std::is_same_v<T, int8_t>)
        for (int64_t h = 0; h < G; h++) {
          radixserve_kv::fwht(of.data() + h * D, D);
          radixserve_kv::flip_value_signs(of.data() + h * D, D);
        }
      for (int64_t h = 0; h < G; h++)
        for (int64_t d = 0; d < D; d++) op[(r * H + h0 + h) * D + d] = static_cast<Q>(of[h * D + d]);
    }
  };
  if (work < kPoolWork)
    items(0, R * KV);
  else
    radixserve::SpinPool::get().run(R * KV, items);
}

}  // namespace

namespace radixserve::cpu {

at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_pages, const at::Tensor& v_pages,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q_in.dim() == 3, "q must be [num_reqs, heads, head_dim]");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();  // rows and heads may be strided
  TORCH_CHECK(k_pages.dim() == 4 && v_pages.dim() == 4 && k_pages.sizes().slice(0, 3) == v_pages.sizes().slice(0, 3) &&
                  k_pages.is_contiguous() && v_pages.is_contiguous() && k_pages.scalar_type() == v_pages.scalar_type(),
              "k_pages / v_pages must be contiguous [num_pages, page_size, kv_heads, row] of one dtype");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KV = k_pages.size(2);
  const int64_t num_pages = k_pages.size(0), ps = k_pages.size(1);
  const auto qt = q.scalar_type(), kt = k_pages.scalar_type();
  const int64_t KG = radixserve_kv::scale_group(D, k_pages.size(3));
  const int64_t VG = radixserve_kv::scale_group(D, v_pages.size(3));
  TORCH_CHECK(kt == at::kChar ? KG > 0 && KG % 16 == 0 && VG > 0 && VG % 16 == 0 && radixserve_kv::is_pow2(D)
                              : k_pages.size(3) == D && v_pages.size(3) == D,
              "pool rows must be head_dim values (int8: head_dim a power of two, its values and a 2-byte scale per "
              "group of a multiple of 16)");
  TORCH_CHECK(KV > 0 && H % KV == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.dim() == 2 && page_table.size(0) == R &&
                  page_table.is_contiguous(),
              "page_table must be contiguous int32 [num_reqs, pages]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == R && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32 [num_reqs]");
  // Every page read must exist: checked here, on the calling thread, so a bad table raises instead of crashing.
  const int32_t *tp = page_table.data_ptr<int32_t>(), *lp = seq_lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; r++) {
    TORCH_CHECK(lp[r] >= 0 && lp[r] <= page_table.size(1) * ps, "seq_lens[", r, "] = ", lp[r], " exceeds its pages");
    for (int64_t j = 0; j < (lp[r] + ps - 1) / ps; j++) {
      const int32_t page = tp[r * page_table.size(1) + j];
      TORCH_CHECK(page >= 0 && page < num_pages, "page_table[", r, ", ", j, "] = ", page, " is not a pool page");
    }
  }
  at::Tensor out = q.new_empty({R, H, D});
  TORCH_CHECK((qt == at::kFloat || qt == at::kBFloat16) && (kt == at::kFloat || kt == at::kBFloat16 || kt == at::kChar),
              "decode_attention: q must be float32 or bfloat16, the pool float32, bfloat16 or int8");
  if (kt == at::kChar && qt == at::kFloat)
    run<float, int8_t>(q, k_pages, v_pages, page_table, seq_lens, scale, out);
  else if (kt == at::kChar)
    run<at::BFloat16, int8_t>(q, k_pages, v_pages, page_table, seq_lens, scale, out);
  else if (qt == at::kFloat && kt == at::kFloat)
    run<float, float>(q, k_pages, v_pages, page_table, seq_lens, scale, out);
  else if (qt == at::kFloat)
    run<float, at::BFloat16>(q, k_pages, v_pages, page_table, seq_lens, scale, out);
  else if (kt == at::kFloat)
    run<at::BFloat16, float>(q, k_pages, v_pages, page_table, seq_lens, scale, out);
  else
    run<at::BFloat16, at::BFloat16>(q, k_pages, v_pages, page_table, seq_lens, scale, out);
  return out;
}

}  // namespace radixserve::cpu

// Weight-only int8 linear for steps of a few rows (decode): y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
//
// Layout (radixserve/model/quant.py, pack_int8): the codes are uint8 (q + 128) in [N/8][K/64][8][64]: the 64-column
// slices of 8 consecutive output rows lie one after another, so a block of 8 rows streams contiguous memory (rows
// read side by side from the plain [N, K] layout defeat the hardware prefetcher: 3x slower from DRAM, measured).
// N and K are padded to multiples of 8 and 64 with code 128 (weight 0).
//
// Paths, chosen at compile time (-march=native):
// - AVX-512 VNNI, 3+ rows: x is quantized to int8 per block of 32 columns (scale = absmax / 127, as llama.cpp quantizes
//   activations for its Q8_0 dot products); vpdpbusd multiplies 64 uint8 codes by 64 int8 activations at once.
//   The codes' +128 adds 128 * sum(xq) * xscale per block, the same for every row: subtracted once per row.
//   1-2 rows take the float path below with 16 lanes (as fast there: the codes' bytes bound it), except in
//   batch-invariant mode (--deterministic), where every row count takes the VNNI path: a row's sums are then the
//   same ops in the same order whatever else is in the step (each row is quantized alone, each output's 64-column
//   dot products are added in K order; the tiling and the threads only pick which row and block run when).
// - AVX2 + FMA: float32 activations, codes widened to float (no rounding of x).
// - otherwise: the same in plain C++.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include "int8_layout.h"
#include "ops.h"
#include "spin_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using radixserve::int8::check_packed;
using radixserve::int8::kCols;
using radixserve::int8::kRows;

constexpr int64_t kPrefetch = 4096;  // bytes ahead of the 8-row stream (measured: 1-16 KiB within 10%, 4 KiB best)
// Below this many bytes of codes one thread does the whole matrix: handing half of a 1 MB projection to another
// thread saves less than the hand-over costs.
constexpr int64_t kSerialBytes = int64_t{2} << 20;

// Blocks of 8 rows split between the spin pool's threads (spin_pool.h; RADIXSERVE_SPIN_POOL=0: torch's OpenMP
// threads instead), or inline when the matrix is small.
// M rows of x count as one pass over the codes per 16 rows: a 512-row step over a small matrix is still worth the
// threads.
template <typename F>
void for_blocks(int64_t NB, int64_t K, int64_t M, const F& f) {
  static const bool spin_pool = [] {
    const char* v = std::getenv("RADIXSERVE_SPIN_POOL");
    return v == nullptr || std::string(v) != "0";
  }();
  if (NB * kRows * K * ((M + 15) / 16) < kSerialBytes)
    f(int64_t{0}, NB);
  else if (spin_pool)
    radixserve::SpinPool::get().run(NB, f);
  else
    at::parallel_for(0, NB, 1, f);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

constexpr int64_t kXBlock = 32;

// One row of x as the VNNI path reads it: int8 values, 16 scales per 64 columns (lanes 0-7: the first block of 32
// columns, lanes 8-15: the second, matching vpdpbusd's int32 lanes), and the codes' +128 correction.
struct QuantRow {
  const int8_t* q;
  const float* s;
  float corr;
};

float quantize_row(const float* x, int64_t K, int8_t* q, float* s) {
  double corr = 0;
  for (int64_t b = 0; b < K / kXBlock; b++) {
    const __m512 lo = _mm512_loadu_ps(x + b * kXBlock), hi = _mm512_loadu_ps(x + b * kXBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float scale = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // round to nearest even
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kXBlock), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kXBlock + 16), _mm512_cvtsepi32_epi8(qhi));
    corr += 128.0 * scale * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    for (int j = 0; j < 8; j++) s[b * 8 + j] = scale;
  }
  return static_cast<float>(corr);
}

// 8 output rows x MR rows of x; y[m * ldy + i].
template <int MR>
inline void vnni_block(const uint8_t* w, int64_t K, const QuantRow* xr, const float* scale, float* y, int64_t ldy) {
  __m512 acc[MR][kRows];
  for (int m = 0; m < MR; m++)
    for (int i = 0; i < kRows; i++) acc[m][i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / kCols; c++, w += kRows * kCols) {
    for (int l = 0; l < kRows; l++) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch + l * 64), _MM_HINT_T0);
    __m512i xv[MR];
    __m512 sv[MR];
    for (int m = 0; m < MR; m++) {
      xv[m] = _mm512_loadu_si512(xr[m].q + c * kCols);
      sv[m] = _mm512_loadu_ps(xr[m].s + c * 16);
    }
    for (int i = 0; i < kRows; i++) {
      const __m512i wv = _mm512_loadu_si512(w + i * kCols);
      for (int m = 0; m < MR; m++) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv[m]);
        acc[m][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sv[m], acc[m][i]);
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int i = 0; i < kRows; i++) y[m * ldy + i] = (_mm512_reduce_add_ps(acc[m][i]) - xr[m].corr) * scale[i];
}

// Float activations, codes widened to float: for 1-2 rows the step is bound by reading the codes, so this is as fast
// as VNNI (measured within 4%) and does not round x.
template <int MR>
inline void fma_block(const uint8_t* w, int64_t K, const float* x, const float* scale, float* y, int64_t ldy) {
  __m512 acc[MR][kRows];
  for (int m = 0; m < MR; m++)
    for (int i = 0; i < kRows; i++) acc[m][i] = _mm512_setzero_ps();
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));  // uint8 (q + 128) xor 0x80 = int8 q
  for (int64_t c = 0; c < K / kCols; c++, w += kRows * kCols) {
    for (int l = 0; l < kRows; l++) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch + l * 64), _MM_HINT_T0);
    for (int j = 0; j < kCols; j += 16) {
      __m512 xv[MR];
      for (int m = 0; m < MR; m++) xv[m] = _mm512_loadu_ps(x + m * K + c * kCols + j);
      for (int i = 0; i < kRows; i++) {
        const __m128i q = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i * kCols + j)), flip);
        const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
        for (int m = 0; m < MR; m++) acc[m][i] = _mm512_fmadd_ps(wv, xv[m], acc[m][i]);
      }
    }
  }
  for (int m = 0; m < MR; m++)
    for (int i = 0; i < kRows; i++) y[m * ldy + i] = _mm512_reduce_add_ps(acc[m][i]) * scale[i];
}

// Many rows (prefill) go through the codes in tiles: kRowTile quantized rows against kTileBytes of codes, both
// held in L2, rather than every row against every block (the rows of a 512-token step at K = 4864 are 2.5 MB).
constexpr int64_t kRowTile = 64;
constexpr int64_t kTileBytes = 256 << 10;

// Rows m0 .. m1 - 1 against blocks b0 .. b1 - 1, pairs of rows at a time (each row's arithmetic is the same in
// vnni_block<2> and <1>: the pairing only shares the loads of the codes).
void vnni_rows(const uint8_t* w, int64_t K, const QuantRow* rows, const float* scale, float* y, int64_t N, int64_t b0,
               int64_t b1, int64_t m0, int64_t m1) {
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* wb = w + b * kRows * K;
    int64_t m = m0;
    for (; m + 2 <= m1; m += 2) vnni_block<2>(wb, K, rows + m, scale + b * kRows, y + m * N + b * kRows, N);
    if (m < m1) vnni_block<1>(wb, K, rows + m, scale + b * kRows, y + m * N + b * kRows, N);
  }
}

void linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t NB, const float* scale, float* y,
                 bool invariant) {
  const int64_t N = NB * kRows;
  if (M <= 2 && !invariant) {
    for_blocks(NB, K, M, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; b++) {
        const uint8_t* wb = w + b * kRows * K;
        if (M == 2)
          fma_block<2>(wb, K, x, scale + b * kRows, y + b * kRows, N);
        else
          fma_block<1>(wb, K, x, scale + b * kRows, y + b * kRows, N);
      }
    });
    return;
  }
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * K / kXBlock * 8);
  std::vector<QuantRow> rows(M);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {  // each row alone: the split changes no value
    for (int64_t m = r0; m < r1; m++) {
      int8_t* q = xq.data() + m * K;
      float* s = xs.data() + m * K / kXBlock * 8;
      rows[m] = {q, s, quantize_row(x + m * K, K, q, s)};
    }
  });
  const int64_t tile_blocks = std::max<int64_t>(1, kTileBytes / (kRows * K));
  for_blocks(NB, K, M, [&](int64_t b0, int64_t b1) {
    for (int64_t t0 = b0; t0 < b1; t0 += tile_blocks)
      for (int64_t m0 = 0; m0 < M; m0 += kRowTile)
        vnni_rows(w, K, rows.data(), scale, y, N, t0, std::min(b1, t0 + tile_blocks), m0, std::min(M, m0 + kRowTile));
  });
}

#elif defined(__AVX2__) && defined(__FMA__)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline void fma_block(const uint8_t* w, int64_t K, const float* x, const float* scale, float* y) {
  __m256 acc[kRows];
  for (int i = 0; i < kRows; i++) acc[i] = _mm256_setzero_ps();
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));  // uint8 (q + 128) xor 0x80 = int8 q
  for (int64_t c = 0; c < K / kCols; c++, w += kRows * kCols) {
    for (int l = 0; l < kRows; l++) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch + l * 64), _MM_HINT_T0);
    for (int j = 0; j < kCols; j += 8) {
      const __m256 xv = _mm256_loadu_ps(x + c * kCols + j);
      for (int i = 0; i < kRows; i++) {
        const __m128i q = _mm_xor_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i * kCols + j)), flip);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), xv, acc[i]);
      }
    }
  }
  for (int i = 0; i < kRows; i++) y[i] = hsum(acc[i]) * scale[i];
}

// Every row count takes the same per-row loop here, so the path is batch-invariant already (`invariant` unused).
void linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t NB, const float* scale, float* y,
                 bool /*invariant*/) {
  const int64_t N = NB * kRows;
  for_blocks(NB, K, M, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)
      for (int64_t m = 0; m < M; m++)
        fma_block(w + b * kRows * K, K, x + m * K, scale + b * kRows, y + m * N + b * kRows);
  });
}

#else

// Every row count takes the same per-row loop here, so the path is batch-invariant already (`invariant` unused).
void linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t NB, const float* scale, float* y,
                 bool /*invariant*/) {
  const int64_t N = NB * kRows;
  for_blocks(NB, K, M, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)
      for (int64_t m = 0; m < M; m++) {
        float acc[kRows] = {0};
        const uint8_t* wb = w + b * kRows * K;
        for (int64_t c = 0; c < K / kCols; c++)
          for (int i = 0; i < kRows; i++)
            for (int j = 0; j < kCols; j++)
              acc[i] += x[m * K + c * kCols + j] * (static_cast<int>(wb[(c * kRows + i) * kCols + j]) - 128);
        for (int i = 0; i < kRows; i++) y[m * N + b * kRows + i] = acc[i] * scale[b * kRows + i];
      }
  });
}

#endif

}  // namespace

namespace radixserve::cpu {

// y = x (codes * scale)^T + bias for a few rows: x float32 or bfloat16 [M, K_in] (K_in <= K, zero-padded here),
// y [M, out_features] in x's dtype. Conversions, padding and the bias are done here rather than as separate torch
// ops: at ~100 linears per decode step, each extra op cost ~15 us of dispatch (measured), 1.5 ms a step.
// batch_invariant: one path for every row count (see the top of the file), for any number of rows.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t out_features, bool batch_invariant) {
  check_packed(packed);
  const int64_t NB = packed.size(0), K = packed.size(1) * kCols, N = NB * kRows, M = x.size(0), K_in = x.size(1);
  TORCH_CHECK(x.dim() == 2 && K_in <= K && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, <= ", K, "]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "scale must be float32 [", N, "]");
  TORCH_CHECK(out_features <= N && (!bias || bias->numel() == out_features), "bad out_features or bias");
  const at::Tensor xc = x.contiguous();
  std::vector<float> xf(M * K, 0.f);  // zero-padded to K
  std::vector<float> b(out_features, 0.f);
  if (bias) {
    const at::Tensor bc = bias->to(at::kFloat).contiguous();
    std::copy_n(bc.data_ptr<float>(), out_features, b.data());
  }
  at::Tensor out = x.new_empty({M, out_features});
  if (M == 0) return out;  // a step whose rows all skip the LM head
  std::vector<float> y(M * N);
  auto run = [&](const auto* xp, auto* o) {  // the same for float32 and bfloat16 x
    // Row by row, on the threads only for prefill-sized steps (a decode step's rows are not worth waking them).
    at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t m = r0; m < r1; m++)
        for (int64_t k = 0; k < K_in; k++) xf[m * K + k] = static_cast<float>(xp[m * K_in + k]);
    });
    linear_rows(xf.data(), M, K, packed.data_ptr<uint8_t>(), NB, scale.data_ptr<float>(), y.data(), batch_invariant);
    at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t m = r0; m < r1; m++)
        for (int64_t n = 0; n < out_features; n++)
          o[m * out_features + n] = static_cast<std::remove_pointer_t<decltype(o)>>(y[m * N + n] + b[n]);
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(xc.data_ptr<float>(), out.data_ptr<float>());
  else
    run(xc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace radixserve::cpu

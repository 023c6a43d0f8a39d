// Weight-only int8 linear for steps of a few rows (decode): y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
//
// Layout (radixserve/model/quant.py, pack_int8): the codes are uint8 (q + 128) in [N/8][K/64][8][64]: the 64-column
// slices of 8 consecutive output rows lie one after another, so a block of 8 rows streams contiguous memory (rows
// read side by side from the plain [N, K] layout defeat the hardware prefetcher: 3x slower from DRAM, measured).
// N and K are padded to multiples of 8 and 64 with code 128 (weight 0).
//
// Paths, chosen at compile time (-march=native):
// - AVX-512 VNNI: x is quantized to int8 per block of 32 columns (scale = absmax / 127, as llama.cpp quantizes
//   activations for its Q8_0 dot products); vpdpbusd multiplies 64 uint8 codes by 64 int8 activations at once.
//   The codes' +128 adds 128 * sum(xq) * xscale per block, the same for every row: subtracted once per row.
// - AVX2 + FMA: float32 activations, codes widened to float (no rounding of x).
// - otherwise: the same in plain C++.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 8;
constexpr int64_t kCols = 64;
constexpr int64_t kPrefetch = 4096;  // bytes ahead of the 8-row stream (measured: 1-16 KiB within 10%, 4 KiB best)

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

void linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t NB, const float* scale, float* y) {
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * K / kXBlock * 8);
  std::vector<QuantRow> rows(M);
  for (int64_t m = 0; m < M; m++) {
    int8_t* q = xq.data() + m * K;
    float* s = xs.data() + m * K / kXBlock * 8;
    rows[m] = {q, s, quantize_row(x + m * K, K, q, s)};
  }
  const int64_t N = NB * kRows;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      const uint8_t* wb = w + b * kRows * K;
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) vnni_block<2>(wb, K, rows.data() + m, scale + b * kRows, y + m * N + b * kRows, N);
      if (m < M) vnni_block<1>(wb, K, rows.data() + m, scale + b * kRows, y + m * N + b * kRows, N);
    }
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

void linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t NB, const float* scale, float* y) {
  const int64_t N = NB * kRows;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)
      for (int64_t m = 0; m < M; m++)
        fma_block(w + b * kRows * K, K, x + m * K, scale + b * kRows, y + m * N + b * kRows);
  });
}

#else

void linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t NB, const float* scale, float* y) {
  const int64_t N = NB * kRows;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
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

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(2) == kRows &&
                  packed.size(3) == kCols && packed.is_contiguous(),
              "int8 codes must be packed uint8 [N/8, K/64, 8, 64] (radixserve.model.quant.pack_int8)");
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  check_packed(packed);
  const int64_t NB = packed.size(0), K = packed.size(1) * kCols;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat, "x must be float32 [M, ", K, "]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == NB * kRows && scale.is_contiguous(),
              "scale must be float32 [", NB * kRows, "]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), NB * kRows}, x.options());
  linear_rows(xc.data_ptr<float>(), x.size(0), K, packed.data_ptr<uint8_t>(), NB, scale.data_ptr<float>(),
              y.data_ptr<float>());
  return y;
}

template <typename T>
void unpack_into(const uint8_t* w, int64_t NB, int64_t K, T* out) {
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)
      for (int64_t c = 0; c < K / kCols; c++)
        for (int64_t i = 0; i < kRows; i++) {
          const uint8_t* src = w + ((b * (K / kCols) + c) * kRows + i) * kCols;
          T* dst = out + (b * kRows + i) * K + c * kCols;
          for (int64_t j = 0; j < kCols; j++) dst[j] = static_cast<T>(static_cast<float>(static_cast<int>(src[j]) - 128));
        }
  });
}

// The codes as a plain [N, K] matrix of `dtype` (float32 or bfloat16; int8 values are exact in both), unscaled.
at::Tensor int8_unpack(const at::Tensor& packed, at::ScalarType dtype) {
  check_packed(packed);
  const int64_t NB = packed.size(0), K = packed.size(1) * kCols;
  at::Tensor out = at::empty({NB * kRows, K}, packed.options().dtype(dtype));
  if (dtype == at::kFloat)
    unpack_into(packed.data_ptr<uint8_t>(), NB, K, out.data_ptr<float>());
  else if (dtype == at::kBFloat16)
    unpack_into(packed.data_ptr<uint8_t>(), NB, K, out.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "int8_unpack: dtype must be float32 or bfloat16");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.def("int8_unpack(Tensor packed, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_unpack", &int8_unpack);
}
